"""The host driver's libnvidia-ml and nvidia-smi found under a driver root and copied for the agent's containers."""

from pathlib import Path

from click.testing import CliRunner

from agent.cli import main
from agent.gpu.driver_files import copy_driver_files, locate


def install(root: Path, lib_dir: str, bin_dir: str | None = "usr/bin") -> None:
    (root / lib_dir).mkdir(parents=True)
    (root / lib_dir / "libnvidia-ml.so.535.161.07").write_text("nvml")
    (root / lib_dir / "libnvidia-ml.so.1").symlink_to("libnvidia-ml.so.535.161.07")
    if bin_dir:
        (root / bin_dir).mkdir(parents=True, exist_ok=True)
        (root / bin_dir / "nvidia-smi").write_text("smi")


def test_a_host_installed_driver_is_found_at_the_root(tmp_path: Path):
    """Ubuntu's layout on the host (/usr/lib/x86_64-linux-gnu, /usr/bin)."""
    install(tmp_path, "usr/lib/x86_64-linux-gnu")
    found = locate(tmp_path)
    assert found is not None and found.library == tmp_path / "usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1"
    assert found.binary == tmp_path / "usr/bin/nvidia-smi"


def test_the_gpu_operators_containerized_driver_wins_over_a_stale_host_library(tmp_path: Path):
    """/run/nvidia/driver (the driver container's rootfs) is the driver the kernel runs where it exists."""
    install(tmp_path, "usr/lib64")
    install(tmp_path / "run/nvidia/driver", "usr/lib/x86_64-linux-gnu")
    found = locate(tmp_path)
    assert found is not None and found.library.is_relative_to(tmp_path / "run/nvidia/driver")


def test_gkes_driver_installer_layout_is_found(tmp_path: Path):
    """GKE: /home/kubernetes/bin/nvidia/{lib64,bin}."""
    install(tmp_path / "home/kubernetes/bin/nvidia", "lib64", "bin")
    found = locate(tmp_path)
    assert found is not None and found.binary == tmp_path / "home/kubernetes/bin/nvidia/bin/nvidia-smi"


def test_the_copy_follows_links_and_lands_where_the_containers_look(tmp_path: Path):
    """lib/libnvidia-ml.so.1 (a file, not a dangling link) and bin/nvidia-smi under the target."""
    install(tmp_path / "host", "usr/lib/x86_64-linux-gnu")
    message = copy_driver_files(tmp_path / "host", tmp_path / "nvidia")
    copied = tmp_path / "nvidia/lib/libnvidia-ml.so.1"
    assert copied.is_file() and not copied.is_symlink() and copied.read_text() == "nvml"
    assert (tmp_path / "nvidia/bin/nvidia-smi").read_text() == "smi"
    assert message.startswith("copied ")


def test_no_driver_is_one_line_and_exit_zero(tmp_path: Path):
    """A node without the driver yet: the pod still starts, and the line says what the agent will read."""
    result = CliRunner().invoke(main, ["driver-files", "--root", str(tmp_path), "--to", str(tmp_path / "out")])
    assert result.exit_code == 0
    assert result.stderr.strip().startswith("driver-files: no libnvidia-ml.so.1 under")
    assert "Traceback" not in result.output


def test_a_driver_not_there_yet_is_waited_for(tmp_path: Path):
    """The GPU Operator's driver pod mounts /run/nvidia/driver after the agent's pod started: found once it does."""
    now = [0.0]
    (tmp_path / "run/nvidia/driver").mkdir(parents=True)  # the operator's mount point, its driver not mounted yet

    def sleep(seconds: float) -> None:
        now[0] += seconds
        if now[0] >= 6:
            install(tmp_path / "run/nvidia/driver", "usr/lib/x86_64-linux-gnu")

    message = copy_driver_files(tmp_path, tmp_path / "out", wait_seconds=120, clock=lambda: now[0], sleep=sleep)
    assert message.startswith("copied ") and now[0] == 6


def test_a_node_with_no_sign_of_a_driver_is_not_waited_for(tmp_path: Path):
    """No library and no GPU Operator mount point: the agent starts at once (its GPUs read Unknown)."""
    waited: list[float] = []
    message = copy_driver_files(tmp_path, tmp_path / "out", wait_seconds=120, sleep=waited.append)
    assert message.startswith("no libnvidia-ml.so.1") and waited == []
