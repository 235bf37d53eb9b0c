"""The operations page covers what a platform team does, and the README leads to it."""

from tests.conftest import REPO

PAGE = (REPO / "docs" / "operations.md").read_text()


def test_the_operations_page_covers_the_lifecycle_and_its_prerequisites():
    """Install, upgrade, pause, opt-out, drill, uninstall and cleanup, with the prerequisites."""
    for section in ("## Prerequisites", "## Install", "## Upgrade", "## Pause and opt-out", "## Fire drill",
                    "## Uninstall and clean up"):
        assert section in PAGE
    for prerequisite in ("Kubernetes 1.30", "Dockerfile", "runtimeClassName", "--metric-labels-allowlist"):
        assert prerequisite in PAGE


def test_the_readme_documents_exit_codes_drill_and_undo_and_links_the_page():
    """The README has the exit-code table, the drill and the undo, and points to docs/operations.md."""
    readme = (REPO / "README.md").read_text()
    assert "## Exit codes" in readme and "## Fire drill and undo" in readme
    assert "(docs/operations.md)" in readme
