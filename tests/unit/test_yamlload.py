import pytest
import yaml

from agent.yamlload import safe_load


def test_yaml_is_read_with_libyaml_where_pyyaml_has_it():
    """The rule catalog's load time and memory depend on the C loader; PyYAML wheels ship it."""
    from agent import yamlload
    assert yamlload._SAFE_LOADER is getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    assert hasattr(yaml, "CSafeLoader")


def test_a_python_object_tag_is_refused_not_constructed():
    """Safe loading: a rules or config file cannot make the agent build arbitrary objects."""
    with pytest.raises(yaml.YAMLError):
        safe_load("!!python/object/apply:os.system ['true']")


def test_the_c_and_python_loaders_read_the_shipped_rules_alike():
    """Switching loaders changed nothing the rules say."""
    from agent.engine import builtin_rules_dir
    for path in sorted(builtin_rules_dir().glob("*.yaml")):
        text = path.read_text()
        assert safe_load(text) == yaml.load(text, Loader=yaml.SafeLoader)
