"""Flower is optional: the core package imports and runs without flwr, `fedbayes deploy` says how
to get it, and `--print-commands` prints a TLS federation's commands."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "examples" / "flower" / "breast_cancer_fedavg.toml"
NO_FLWR = "import sys; sys.modules['flwr'] = None\n"  # `import flwr` now raises ImportError


def _python(code: str, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", ""), "JAX_PLATFORMS": "cpu"}
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, env=env, timeout=300)


def test_core_package_imports_without_flwr():
    code = NO_FLWR + (
        "import fedbayes, fedbayes.cli, fedbayes.runs.loop, fedbayes.sim.simulator, fedbayes.protocol\n"
        "from fedbayes.config.schema import load_config\n"
        f"cfg = load_config({str(CONFIG)!r})\n"
        "assert 'flwr' not in [m for m in sys.modules if sys.modules[m] is not None]\n"
        "print('ok', cfg.data.num_clients)\n"
    )
    res = _python(code)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.strip() == "ok 3"


def test_deploy_without_flwr_is_one_line_naming_the_extra():
    code = NO_FLWR + "from fedbayes.cli import main; sys.argv = ['fedbayes', 'deploy', sys.argv[1], '--out', sys.argv[2]]; sys.exit(main())"
    res = _python(code, str(CONFIG), "/nonexistent/out")
    assert res.returncode == 2, res.stderr[-2000:]
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "pip install -e '.[flower]'" in lines[0]


def test_print_commands_uses_tls_not_insecure():
    code = "from fedbayes.cli import main; sys.argv = ['fedbayes', 'deploy', sys.argv[1], '--print-commands']; sys.exit(main())"
    res = _python("import sys\n" + code, str(CONFIG))
    assert res.returncode == 0, res.stderr[-2000:]
    out = res.stdout
    flower = [line for line in out.splitlines() if not line.startswith("#") and "fedbayes.flower.executor" not in line]
    assert not any("--insecure" in line for line in flower)  # only the executor's loopback Runtime API is plain HTTP
    for flag in ("--ssl-ca-certfile", "--ssl-certfile", "--ssl-keyfile", "--root-certificates", "--enable-supernode-auth", "--auth-supernode-private-key"):
        assert flag in out
    assert out.count("flower-supernode --") == 3 and "partition-id=2 num-partitions=3" in out and "data-file=" in out
    assert out.count("python -m fedbayes.flower.executor") == 3 and out.count("--isolation process") == 3
    assert out.count("flwr supernode register") == 3 and "flwr run fedbayes-app" in out


def test_the_printed_connection_is_added_once_and_keeps_the_users_own(tmp_path):
    """Run twice (as a user rerunning the printed steps does), the step that writes Flower's
    connection leaves one [superlink] table and one connection, and an existing one untouched."""
    import tomllib

    from fedbayes.config.schema import load_config
    from fedbayes.flower.deploy import print_commands

    text = print_commands(CONFIG, load_config(CONFIG), tmp_path / "out", "10.0.0.1", 9092)
    (step,) = [line for line in text.splitlines() if "~/.flwr/config.toml" in line and not line.startswith("#")]
    home = tmp_path / "home"
    (home / ".flwr").mkdir(parents=True)
    (home / ".flwr" / "config.toml").write_text('[superlink]\ndefault = "mine"\n\n[superlink.mine]\naddress = "127.0.0.1:9093"\ninsecure = true\n')
    for _ in range(2):
        subprocess.run(["bash", "-c", step], env={**os.environ, "HOME": str(home)}, check=True)
    written = (home / ".flwr" / "config.toml").read_text()
    config = tomllib.loads(written)  # a table written twice would not parse
    assert config["superlink"]["default"] == "mine" and config["superlink"]["mine"]["insecure"] is True
    assert [k for k in config["superlink"] if k != "default"] == ["mine", "local"] and written.count("[superlink.local]") == 1
    assert config["superlink"]["local"]["address"] == "10.0.0.1:9092"


def test_the_printed_commands_need_the_number_of_clients(tmp_path):
    """A node per client is started before any data is read: the data's own number of clients
    (``data.num_clients`` unset) cannot be counted where the commands are printed."""
    from fedbayes.config.schema import validate
    from fedbayes.errors import BadInputError
    from fedbayes.flower.deploy import print_commands

    config = validate({"data": {"dataset": "leaf"}, "server": {"clients_per_round": 2}})
    with pytest.raises(BadInputError, match=r"^config error: data.num_clients: the commands start one SuperNode per client before any data is read"):
        print_commands(CONFIG, config, tmp_path / "out", "10.0.0.1", 9092)
