"""The storm path compiled with mypyc: one list names it, builds compile all of it or none, and the build says so."""

import re
from pathlib import Path

from click.testing import CliRunner

from agent.cli import main
from agent.hot_path import COMPILED_MODULES, compiled_modules, describe

REPO = Path(__file__).resolve().parents[2]


def test_a_build_runs_the_whole_storm_path_compiled_or_none_of_it():
    """A partly compiled storm path is a packaging error (the suite runs on both builds, scripts/test)."""
    assert compiled_modules() in {(), COMPILED_MODULES}


def test_every_module_named_for_compilation_is_a_module_of_the_package():
    """compile-hot-path compiles the files these names give; a renamed module must not drop out silently."""
    for name in COMPILED_MODULES:
        assert (REPO / (name.replace(".", "/") + ".py")).is_file(), name


def test_the_version_says_whether_the_storm_path_is_compiled():
    """An operator can tell from `--version` which build a node runs."""
    output = CliRunner().invoke(main, ["--version"], catch_exceptions=False).output
    assert re.fullmatch(r"gpu-health-agent, version \S+ \((.+)\)\n", output)
    assert describe() in output
    expected = f"compiled with mypyc: {len(COMPILED_MODULES)} of" if compiled_modules() else "interpreted"
    assert expected in output


def test_the_image_compiles_the_storm_path_and_its_runtime_stage_checks_it():
    """The build stage compiles and installs everything into the agent's virtualenv; the runtime stage, which
    has only what was copied from it, runs the agent and fails the build unless its storm path is compiled."""
    build, runtime = (REPO / "Dockerfile").read_text().split("\nFROM ${BASE}\n")
    assert "RUN scripts/install-agent /src /opt/gpu-health-agent" in build
    install = (REPO / "scripts/install-agent").read_text()
    assert '"$build/venv/bin/python" "$src/scripts/compile-hot-path" "$src"' in install
    assert "COPY --from=build /opt/gpu-health-agent /opt/gpu-health-agent" in runtime
    assert 'RUN /opt/gpu-health-agent/bin/gpu-health-agent --version | grep -q "compiled with mypyc"' in runtime
