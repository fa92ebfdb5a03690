"""``fedbayes deploy``: a federation of real Flower processes on this machine, or the commands to
start one on real machines.

:class:`LocalFederation` starts a SuperLink and one SuperNode per client on free loopback ports,
each with its own ``FLWR_HOME`` and state folder (and, with ``executor = "warm"``, the default,
``--isolation process`` and a warm fedbayes executor beside it: :mod:`fedbayes.flower.executor`;
the node's XLA cache and Flower's telemetry set in its environment), writes the Flower app (a ``pyproject.toml`` that
names :mod:`fedbayes.flower.apps`), submits runs with ``flwr run`` and waits for them, and tears
everything down: every process it started and all their descendants (the SuperLink starts its
SuperExec and the ServerApp in sessions of their own, so teardown walks the process tree, kills
each process group and then each process; SIGTERM, then SIGKILL), also on Ctrl-C and on failure.

With ``tls=True`` the federation runs over TLS with certificates made here (a CA, and a
certificate for 127.0.0.1/localhost signed by it: :func:`make_certificates`).
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from fedbayes.errors import BadInputError, FedbayesError
from fedbayes.flower import INSTALL
from fedbayes.runs import folder as run_folder

APP_NAME = "fedbayes-app"
APP_MODULE = "fedbayes.flower.apps"
CONNECTION = "local"
# Environment of every Flower process: the SuperExecs poll for tasks every 50 ms instead of 1 s.
FAST_POLL = {"FLWR_SUPEREXEC_TASK_POLL_INTERVAL": "0.05"}
# ... but the SuperLink's: it only starts a run's ServerApp, and every poll is a request the
# SuperLink serves through every round (counts per round in docs/results/flower.md). A run starts
# up to 1 s later.
SUPERLINK_POLL = {"FLWR_SUPEREXEC_TASK_POLL_INTERVAL": "1.0"}
QUIET = {"FLWR_TELEMETRY_ENABLED": "0"}  # no telemetry requests from a deployment's processes
EXECUTORS = ("warm", "stock")  # a warm fedbayes executor per node, or Flower's process per message


class DeployError(FedbayesError):
    """A Flower process that would not start, a run that failed or did not finish (exit code 3)."""

    exit_code = 3


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def app_pyproject(run_config: dict | None = None) -> str:
    """The Flower app's ``pyproject.toml``: fedbayes's ServerApp and ClientApp, the run config keys."""
    from fedbayes.flower.apps import RUN_CONFIG

    values = {**RUN_CONFIG, **(run_config or {})}
    lines = [
        "[build-system]",
        'requires = ["hatchling"]',
        'build-backend = "hatchling.build"',
        "",
        "[project]",
        f'name = "{APP_NAME}"',
        'version = "1.0.0"',
        'description = "fedbayes on Flower: every fedbayes algorithm as a Flower app"',
        'license = "Apache-2.0"',
        "dependencies = []  # fedbayes[flower] is installed where the SuperLink and SuperNodes run",
        "",
        "[tool.hatch.build.targets.wheel]",
        'packages = ["."]',
        "",
        "[tool.flwr.app]",
        'publisher = "fedbayes"',
        "",
        "[tool.flwr.app.components]",
        f'serverapp = "{APP_MODULE}:serverapp"',
        f'clientapp = "{APP_MODULE}:clientapp"',
        "",
        "[tool.flwr.app.config]",
    ]
    lines += [f"{k} = {_toml_value(v)}" for k, v in values.items()]
    return "\n".join(lines) + "\n"


def _toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int | float):
        return repr(v)
    return json.dumps(str(v))


def write_app(folder: Path, run_config: dict | None = None) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "pyproject.toml").write_text(app_pyproject(run_config))
    return folder


def make_certificates(folder: Path, hosts=("127.0.0.1", "localhost")) -> dict[str, Path]:
    """A CA and a server certificate for ``hosts`` signed by it (``ca.crt``, ``server.pem``,
    ``server.key``), made with the ``cryptography`` package (installed with flwr)."""
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    folder.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP384R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "fedbayes test CA")])
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=30))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP384R1())
    names = []
    for h in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(h)))
        except ValueError:
            names.append(x509.DNSName(h))
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, hosts[0])]))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=30))
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    paths = {"ca": folder / "ca.crt", "cert": folder / "server.pem", "key": folder / "server.key"}
    paths["ca"].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    paths["cert"].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    paths["key"].write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    return paths


def make_node_key(folder: Path, name: str) -> tuple[Path, Path]:
    """An EC P-384 key pair for SuperNode authentication, in OpenSSH format
    (``<name>`` and ``<name>.pub``): the SuperNode signs with the private key, the SuperLink
    accepts it once the public key is registered (``flwr supernode register``)."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    folder.mkdir(parents=True, exist_ok=True)
    key = ec.generate_private_key(ec.SECP384R1())
    private, public = folder / name, folder / f"{name}.pub"
    private.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH, serialization.NoEncryption()))
    public.write_bytes(key.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH))
    private.chmod(0o600)
    return private, public


def _bin(name: str) -> str:
    """The Flower command ``name`` next to this Python (the flower extra installs it there)."""
    here = Path(sys.executable).parent / name
    if here.is_file():
        return str(here)
    found = shutil.which(name)
    if found is None:
        raise BadInputError(f"{name} not found next to {sys.executable} or on PATH; install the flower extra {INSTALL}")
    return found


# ----- commands --------------------------------------------------------------------------------
def superlink_command(port: int, certs: dict | None, auth: bool = False) -> list[str]:
    tls = ["--ssl-ca-certfile", str(certs["ca"]), "--ssl-certfile", str(certs["cert"]), "--ssl-keyfile", str(certs["key"])] if certs else ["--insecure"]
    cmd = [_bin("flower-superlink"), *tls, "--host", "127.0.0.1", "--port", str(port), "--disable-runtime-dependency-installation"]
    return cmd + (["--enable-supernode-auth"] if auth else [])


def supernode_command(
    superlink: str,
    port: int,
    partition: int,
    num_partitions: int,
    state_dir: Path,
    certs: dict | None,
    key: Path | None = None,
    *,
    warm: bool = False,
    fast: bool = False,
    data: dict | None = None,
) -> list[str]:
    """A SuperNode's command. ``warm``: ``--isolation process`` (its tasks go to the executor of
    :func:`executor_command`); ``fast``: Flower's SuperNode with its idle sleeps capped
    (:mod:`fedbayes.flower.fastnode`, loopback only); ``data``: the node's data keys
    (:mod:`fedbayes.flower.nodedata`) added to its node config."""
    tls = ["--root-certificates", str(certs["ca"])] if certs else ["--insecure"]
    node_config = f"partition-id={partition} num-partitions={num_partitions} state-dir='{state_dir}'"
    node_config += "".join(f" {k}='{v}'" for k, v in (data or {}).items())
    start = [sys.executable, "-m", "fedbayes.flower.fastnode"] if fast else [_bin("flower-supernode")]
    cmd = [*start, *tls, "--superlink", superlink, "--host", "127.0.0.1", "--port", str(port), "--node-config", node_config]
    cmd += ["--isolation", "process"] if warm else []
    return cmd + (["--auth-supernode-private-key", str(key)] if key is not None else [])


def executor_command(port: int, state_dir: Path, max_tasks: int | None = None) -> list[str]:
    """The warm executor of the SuperNode whose Runtime API is on ``port`` (:mod:`fedbayes.flower.executor`);
    ``max_tasks``: it exits after that many tasks."""
    cmd = [sys.executable, "-m", "fedbayes.flower.executor", "--runtime-api-address", f"127.0.0.1:{port}", "--insecure", "--state-dir", str(state_dir)]
    return cmd + ([] if max_tasks is None else ["--max-tasks", str(max_tasks)])


def print_commands(
    config_path: Path,
    config,
    out: Path,
    superlink_host: str = "SUPERLINK_HOST",
    port: int = 9093,
    *,
    node_host: str = "127.0.0.1",
    node_ports: list[int] | None = None,
    files: str = ".",
    state_root: str = "/var/lib/fedbayes",
) -> str:
    """The commands that start the same federation on real machines: TLS, SuperNode
    authentication, a warm executor next to each SuperNode, each node's data from its own
    configuration. ``node_ports`` (default 9094 on every machine), ``files`` (the folder of the
    certificates and keys on each machine) and ``state_root`` are there so that a test can run the
    printed commands on one machine."""
    k = config.data.num_clients
    if k is None:  # the data is on the nodes: its clients cannot be counted here
        raise BadInputError(
            f"config error: data.num_clients: the commands start one SuperNode per client before any data is read; "
            f"set data.num_clients (the number of clients of the {config.data.dataset} data)"
        )
    q = shlex.quote
    node_ports = node_ports or [9094] * k
    f = lambda name: f"{files}/{name}"  # noqa: E731
    env = "FLWR_TELEMETRY_ENABLED=0 JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0"
    lines = [
        f"# fedbayes on Flower: {config.name} ({config.algorithm.name}, {k} clients, {config.rounds} rounds), over TLS, SuperNodes authenticated.",
        f"# Install on every machine, {INSTALL} (flwr 1.41 or 1.42).",
        f"# Certificates: a CA (ca.crt) and a certificate for {superlink_host} (server.pem, server.key) signed by it, e.g. with openssl;",
        "# ca.crt goes to every machine. Node keys: ssh-keygen -t ecdsa -b 384 -N '' -f nodeI on node I; nodeI.pub to where you submit.",
        "",
        "# 1. On the SuperLink machine (it also runs the ServerApp: the config and the run folder live there):",
        f"{env} flower-superlink --ssl-ca-certfile {f('ca.crt')} --ssl-certfile {f('server.pem')} --ssl-keyfile {f('server.key')} "
        f"--host {'0.0.0.0' if superlink_host == 'SUPERLINK_HOST' else superlink_host} --port {port} --disable-runtime-dependency-installation --enable-supernode-auth",
        "",
        "# 2. Where you submit the run: a connection to the SuperLink, and the nodes' public keys registered (before they start).",
        # once: run again, it leaves a config that has the connection (or any [superlink] table) as it is
        f"mkdir -p ~/.flwr && touch ~/.flwr/config.toml && {{ grep -q '^\\[superlink\\]' ~/.flwr/config.toml || "
        f"printf '[superlink]\\ndefault = \"{CONNECTION}\"\\n' >> ~/.flwr/config.toml; }} && "
        f"{{ grep -q '^\\[superlink\\.{CONNECTION}\\]' ~/.flwr/config.toml || printf '[superlink.{CONNECTION}]\\naddress = \"{superlink_host}:{port}\"\\n"
        f'root-certificates = "{f("ca.crt")}"\\n\' >> ~/.flwr/config.toml; }}',
        *(f"flwr supernode register {f(f'node{i}.pub')} {CONNECTION}" for i in range(k)),
        "",
        f"# 3. On each client machine i = 0..{k - 1}: a SuperNode and its warm fedbayes executor. The node's data is its own:",
        "#    data-file = its examples (.npz with arrays x and y, or .csv with a header and a 'label' column), or",
        "#    dataset = NAME and data-dir = FOLDER (partition-id of the dataset, split as the run's config says).",
        "#    The server's config never names a node's data (a node refuses one that does); its shapes and classes are checked.",
        *(
            [f"#    The run's model is your own module: a node imports it only when its config lists it in model-modules (read {config.model.module} first)."]
            if config.model.module is not None
            else []
        ),
    ]
    for i in range(k):
        state = f"{state_root}/node{i}"
        node_config = f"partition-id={i} num-partitions={k} state-dir='{state}' data-file='{state}/data.npz'"
        node_config += f" model-modules='{config.model.module}'" if config.model.module is not None else ""
        lines += [
            f"JAX_COMPILATION_CACHE_DIR={state}/jax_cache {env} flower-supernode --root-certificates {f('ca.crt')} --superlink {superlink_host}:{port} "
            f'--auth-supernode-private-key {f(f"node{i}")} --isolation process --host {node_host} --port {node_ports[i]} --node-config "{node_config}"',
            f"JAX_COMPILATION_CACHE_DIR={state}/jax_cache {env} python -m fedbayes.flower.executor --runtime-api-address {node_host}:{node_ports[i]} --insecure --state-dir {state}",
        ]
    lines += [
        "",
        "# 4. Where you submit the run: a Flower app folder, and the run (config and run folder on the SuperLink's machine).",
        "mkdir -p fedbayes-app && python -c 'from fedbayes.flower.deploy import app_pyproject; print(app_pyproject(), end=\"\")' > fedbayes-app/pyproject.toml",
        f"flwr run fedbayes-app {CONNECTION} --stream --run-config {q(f'config={json.dumps(str(config_path))} out={json.dumps(str(out))}')}",
        "",
        f"# The run folder ({out}) holds metrics.jsonl, flower_times.jsonl (where each round's time went), checkpoints and",
        "# flower_status.json; to resume, add resume=true to --run-config. Flower's SuperNode waits 3 s after each empty pull:",
        "# a round takes at least about 3 s on real machines (fedbayes deploy on one machine caps that wait).",
    ]
    return "\n".join(lines) + "\n"


# ----- the local federation --------------------------------------------------------------------
@dataclass
class Node:
    partition: int
    port: int
    home: Path
    state_dir: Path
    process: subprocess.Popen | None = None
    key: Path | None = None  # its private key (SuperNode authentication)
    executor: subprocess.Popen | None = None  # its warm executor (executor = "warm")
    data: dict | None = None  # its data keys in its node config (fedbayes.flower.nodedata)
    max_tasks: int | None = None  # its warm executor exits after this many tasks (executor --max-tasks)


@dataclass
class LocalFederation:
    """A SuperLink and ``num_nodes`` SuperNodes on loopback, under ``workdir`` (see the module docstring)."""

    workdir: Path
    num_nodes: int
    tls: bool = False
    auth: bool = False  # SuperNode authentication: each node gets a key, registered with the SuperLink
    executor: str = "warm"  # EXECUTORS: a warm fedbayes executor per node, or Flower's process per message
    env: dict = field(default_factory=dict)
    superlink_port: int = 0
    certs: dict | None = None
    nodes: list[Node] = field(default_factory=list)
    superlink: subprocess.Popen | None = None
    _seen: dict = field(default_factory=dict)  # pid -> psutil.Process of every process seen in the tree

    def __post_init__(self):
        if self.executor not in EXECUTORS:
            raise BadInputError(f"flower: executor must be one of {', '.join(EXECUTORS)}; got {self.executor!r}")
        self.workdir = Path(self.workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.superlink_port = self.superlink_port or free_port()
        if self.tls:
            self.certs = make_certificates(self.workdir / "certs")
        self.nodes = [Node(i, free_port(), self.workdir / f"node{i}" / "home", self.workdir / f"node{i}" / "state") for i in range(self.num_nodes)]
        self.cli_home = self.workdir / "cli_home"
        self.cli_home.mkdir(parents=True, exist_ok=True)
        tls = f'root-certificates = "{self.certs["ca"]}"' if self.certs else "insecure = true"
        (self.cli_home / "config.toml").write_text(
            f'[superlink]\ndefault = "{CONNECTION}"\n\n[superlink.{CONNECTION}]\naddress = "127.0.0.1:{self.superlink_port}"\n{tls}\n'
        )
        self.app_dir = write_app(self.workdir / "app")

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.superlink_port}"

    def _env(self, home: Path, state_dir: Path | None = None, poll: dict = FAST_POLL) -> dict:
        from fedbayes.flower.executor import node_environment

        home.mkdir(parents=True, exist_ok=True)
        env = node_environment(state_dir, {**os.environ, **poll, **QUIET, **self.env, "FLWR_HOME": str(home)})
        env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
        src = str(Path(__file__).resolve().parents[2])  # the fedbayes source tree first, as in this process
        env["PYTHONPATH"] = src + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        return env

    def spawn(self, cmd: list[str], home: Path, log: Path, state_dir: Path | None = None, poll: dict = FAST_POLL) -> subprocess.Popen:
        """Starts one Flower process of this federation (``cmd``, e.g. a SuperNode's command) with
        the federation's environment and ``home`` (and a node's ``state_dir``: its XLA cache), its
        output appended to ``log``; the process is tracked, so :meth:`stop` ends it and its
        children with the rest."""
        env = self._env(home, state_dir, poll)
        with open(log, "ab") as f:
            p = subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        self._seen[p.pid] = psutil.Process(p.pid)
        return p

    def start(self, timeout: float = 60.0) -> None:
        home = self.workdir / "superlink_home"
        self.superlink = self.spawn(superlink_command(self.superlink_port, self.certs, self.auth), home, self.workdir / "superlink.log", poll=SUPERLINK_POLL)
        self._wait_port(self.superlink_port, self.superlink, "superlink", timeout)
        if self.auth:
            for node in self.nodes:
                node.key, public = make_node_key(self.workdir / "keys", f"node{node.partition}")
                self.register(public)
        for node in self.nodes:
            self.start_node(node.partition)
        for node in self.nodes:  # a node that dies at start fails here, not at the ServerApp's node-timeout
            self._wait_port(node.port, node.process, f"node{node.partition}", timeout)

    def _wait_port(self, port: int, process: subprocess.Popen, name: str, timeout: float) -> None:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if process.poll() is not None:
                raise DeployError(f"the {name} exited with code {process.returncode} at start; its log: {self.workdir / (name + '.log')}")
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
            time.sleep(0.1)
        raise DeployError(f"the {name} did not open port {port} within {timeout:g} s; its log: {self.workdir / (name + '.log')}")

    @property
    def warm(self) -> bool:
        return self.executor == "warm"

    def start_node(self, partition: int) -> None:
        node = self.nodes[partition]
        node.state_dir.mkdir(parents=True, exist_ok=True)
        cmd = supernode_command(
            self.address, node.port, partition, self.num_nodes, node.state_dir, self.certs, node.key, warm=self.warm, fast=self.warm, data=node.data
        )
        node.process = self.spawn(cmd, node.home, self.workdir / f"node{partition}.log", node.state_dir)
        if self.warm:
            self.start_executor(partition, node.max_tasks)

    def start_executor(self, partition: int, max_tasks: int | None = None) -> None:
        """Starts node ``partition``'s warm executor (:mod:`fedbayes.flower.executor`); ``max_tasks``:
        it exits after that many tasks (the node's next tasks wait for a new one)."""
        node = self.nodes[partition]
        node.executor = self.spawn(executor_command(node.port, node.state_dir, max_tasks), node.home, self.workdir / f"executor{partition}.log", node.state_dir)

    def kill_executor(self, partition: int) -> None:
        """SIGKILLs node ``partition``'s warm executor (as a crash would)."""
        node = self.nodes[partition]
        if node.executor is not None:
            kill_tree([psutil.Process(node.executor.pid)], signal.SIGKILL)
            node.executor.wait(timeout=10)
            node.executor = None

    def register(self, public_key: Path) -> None:
        """Registers a SuperNode's public key with the SuperLink (``flwr supernode register``)."""
        res = self.flwr("supernode", "register", str(public_key), CONNECTION)
        if res.returncode != 0:
            raise DeployError(f"flwr supernode register {public_key} failed: {' '.join((res.stdout + res.stderr).split())[-300:]}")

    def kill_node(self, partition: int) -> None:
        """SIGKILLs a SuperNode, its warm executor and everything under them (as a crash would)."""
        node = self.nodes[partition]
        self.kill_executor(partition)
        if node.process is not None:
            kill_tree([psutil.Process(node.process.pid)], signal.SIGKILL)
            node.process.wait(timeout=10)
            node.process = None

    def processes(self) -> list[psutil.Process]:
        """Every live process of the federation: the started ones and their descendants."""
        roots = [p for p in list(self._seen.values()) if p.is_running()]
        found = {}
        for p in roots:
            found[p.pid] = p
            with contextlib.suppress(psutil.Error):
                for c in p.children(recursive=True):
                    found[c.pid] = c
        self._seen.update(found)
        return [p for p in found.values() if _alive(p)]

    # ----- runs --------------------------------------------------------------------------------
    def flwr(self, *args: str, timeout: float = 120.0) -> subprocess.CompletedProcess:
        cmd = [_bin("flwr"), *args]
        return subprocess.run(cmd, env=self._env(self.cli_home), capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)

    def submit(self, run_config: dict) -> str:
        """Submits a run of the fedbayes app (``run_config``: :data:`fedbayes.flower.apps.RUN_CONFIG` keys); returns its run id."""
        overrides = " ".join(f"{k}={_toml_value(v)}" for k, v in run_config.items())
        res = self.flwr("run", str(self.app_dir), CONNECTION, "--run-config", overrides, "--format", "json")
        try:
            data = json.loads(res.stdout[res.stdout.index("{") :])
        except ValueError:
            data = {}
        if res.returncode != 0 or not data.get("success", False) or "run-id" not in data:
            tail = " ".join((res.stdout + res.stderr).split())[-400:]
            raise DeployError(f"flwr run failed (exit {res.returncode}): {tail}")
        return str(data["run-id"])

    def run_status(self, run_id: str) -> str:
        res = self.flwr("ls", "--run-id", run_id, "--format", "json")
        with contextlib.suppress(ValueError, KeyError, IndexError):
            return json.loads(res.stdout[res.stdout.index("{") :])["runs"][0]["status"]
        return "unknown"

    def wait(self, run_id: str, out: Path, timeout: float, check_every: float = 30.0, on_poll=None) -> dict:
        """Waits for the run's ``flower_status.json`` (written by the ServerApp) or for Flower to
        report the run finished; returns the status (``{"ok": ..., "error": ..., "exit_code": ...}``).
        The status file is checked every 0.2 s; ``flwr ls`` (a fresh Python with flwr, about a
        CPU-second) only every ``check_every`` seconds, to notice a ServerApp that died without one."""
        from fedbayes.flower.apps import STATUS_FILE

        status_file = Path(out) / STATUS_FILE
        end = time.monotonic() + timeout
        next_check = time.monotonic() + check_every
        while time.monotonic() < end:
            self.processes()  # keep the process tree known while it is alive
            if on_poll is not None:
                on_poll()
            if status_file.is_file():
                with contextlib.suppress(ValueError):
                    status = json.loads(status_file.read_text())
                    self._wait_finished(run_id)
                    return status
            if time.monotonic() > next_check:
                state = self.run_status(run_id)
                if state.startswith("finished"):
                    if status_file.is_file():
                        continue
                    return {"ok": False, "error": f"the ServerApp ended ({state}) without a status; see {self.workdir / 'superlink.log'}", "exit_code": 3}
                next_check = time.monotonic() + check_every
            time.sleep(0.2)
        raise DeployError(f"run {run_id} did not finish within {timeout:g} s")

    def _wait_finished(self, run_id: str, timeout: float = 30.0) -> None:
        end = time.monotonic() + timeout
        while time.monotonic() < end and not self.run_status(run_id).startswith("finished"):
            time.sleep(1.0)

    def run(self, run_config: dict, timeout: float = 3600.0) -> dict:
        run_id = self.submit(run_config)
        return self.wait(run_id, Path(run_config["out"]), timeout)

    def stop(self) -> None:
        """Ends every process of the federation (SIGTERM, then SIGKILL after 5 s)."""
        procs = self.processes()
        kill_tree(procs, signal.SIGTERM)
        _, alive = psutil.wait_procs(procs, timeout=5)
        if alive:
            kill_tree(alive, signal.SIGKILL)
            psutil.wait_procs(alive, timeout=5)
        for p in [self.superlink, *(n.process for n in self.nodes), *(n.executor for n in self.nodes)]:
            if p is not None:
                with contextlib.suppress(Exception):
                    p.wait(timeout=5)

    def __enter__(self):
        self.start()
        return self

    def __exit__(self, *exc):
        self.stop()


def _alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def kill_tree(procs, sig) -> None:
    """Sends ``sig`` to the process groups of ``procs`` (never this process's own) and their descendants."""
    everyone = {}
    for p in procs:
        with contextlib.suppress(psutil.Error):
            everyone[p.pid] = p
            for c in p.children(recursive=True):
                everyone[c.pid] = c
    own = os.getpgrp()
    for p in everyone.values():
        with contextlib.suppress(ProcessLookupError, PermissionError, psutil.Error):
            pgid = os.getpgid(p.pid)
            if pgid != own:
                os.killpg(pgid, sig)
    for p in everyone.values():
        with contextlib.suppress(psutil.Error):
            p.send_signal(sig)


# ----- fedbayes deploy ---------------------------------------------------------------------------
def _error_for(status: dict) -> FedbayesError:
    from fedbayes import errors

    classes = {2: errors.BadInputError, 3: DeployError, 4: errors.RunFolderError, 5: errors.RunFolderBusyError}
    code = int(status.get("exit_code", 3))
    if code == 130:
        return KeyboardInterrupt()
    cls = classes.get(code, DeployError)
    return cls(str(status.get("error") or "the run failed"))


def _num_clients(config, exp) -> int:
    """The nodes to start: ``data.num_clients``, or where it is unset (data that brings its own
    clients) the number the built experiment ``exp`` has, else the number the data splits into."""
    if config.data.num_clients is not None:
        return config.data.num_clients
    if exp is not None:
        return exp.federation.num_clients
    from fedbayes.runs.build import prepare_data

    return len(prepare_data(config)[1])


def deploy_local(
    config,
    out: str | Path,
    *,
    resume: bool = False,
    tls: bool = False,
    run_config: dict | None = None,
    timeout: float = 24 * 3600.0,
    progress=None,
    prepare: bool = True,
    executor: str = "warm",
) -> dict:
    """Runs ``config`` on a local federation of real Flower processes (a SuperLink, one SuperNode
    per client) and returns the run's summary; the run folder is the one ``fedbayes run`` writes,
    plus ``flower/`` (the processes' logs and homes, each node's state folder). Every process is
    ended before this returns, also on Ctrl-C and on failure.

    ``run_config``: the ServerApp's failure settings (``min-nodes``, ``node-timeout``,
    ``reply-timeout``, ``on-missing``, ``poll-interval``); ``progress``: called with each new
    metrics.jsonl record; ``prepare``: write each node's examples into a file of its own first and
    name it in the node's config (``data-file``: one load of the dataset instead of one per node); ``executor``: ``"warm"`` (a long-lived
    fedbayes executor per node, :mod:`fedbayes.flower.executor`) or ``"stock"`` (Flower's fresh
    ClientApp process per message).
    """
    from fedbayes.config.schema import to_toml
    from fedbayes.data import registry as data_registry
    from fedbayes.flower.apps import _settings
    from fedbayes.flower.rounds import check_deployable

    check_deployable(config)
    _settings(run_config or {})  # a bad failure setting fails here, before any process starts
    out = Path(out).resolve()
    work = out / "flower"
    if not resume:
        shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True, exist_ok=True)
    config_file = work / run_folder.CONFIG
    config_file.write_text(to_toml(config))
    # each node's own data file (your own data: the user_data trait), named in its node config (else every node loads the dataset itself)
    exp = None
    if prepare or data_registry.get(config.data.dataset).user_data:
        from fedbayes.runs.build import build_experiment

        exp = build_experiment(config, store_dir=work / "unused_store")
    federation = LocalFederation(work, _num_clients(config, exp), tls=tls, executor=executor)
    # this launcher configures both sides: a user model module is the nodes' own too (nodedata.accept_run_config)
    own = {"model-modules": config.model.module} if config.model.module is not None else {}
    for node in federation.nodes:
        node.data = dict(own) or None
    if exp is not None:
        from fedbayes.flower.node import write_client_file

        for node in federation.nodes:
            node.data = {"data-file": str(write_client_file(exp, node.partition, node.state_dir.parent / "data.npz")), **own}
    seen = 0
    metrics = out / run_folder.METRICS

    def report() -> None:
        nonlocal seen
        if progress is None or not metrics.is_file():
            return
        lines = metrics.read_text().splitlines()
        for line in lines[seen:]:
            with contextlib.suppress(ValueError):
                progress(json.loads(line))
        seen = len(lines)

    from fedbayes.flower.apps import STATUS_FILE

    (out / STATUS_FILE).unlink(missing_ok=True)  # an earlier run's status is not this run's
    try:
        federation.start()
        rc = {**(run_config or {}), "config": str(config_file), "out": str(out), "resume": bool(resume)}
        run_id = federation.submit(rc)
        status = federation.wait(run_id, out, timeout, on_poll=report)
        report()
    finally:
        federation.stop()
    if not status.get("ok"):
        raise _error_for(status)
    return run_folder.read_summary(out)
