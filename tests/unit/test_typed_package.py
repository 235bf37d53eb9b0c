"""The package says it is typed (PEP 561), so a project importing agent gets its annotations checked."""

from importlib.resources import files


def test_the_package_ships_a_py_typed_marker():
    """agent/py.typed is in the package (hatch puts every file of agent/ in the wheel)."""
    assert files("agent").joinpath("py.typed").is_file()
