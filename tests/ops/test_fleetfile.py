"""Fleet files for kafila-ops: the planner's tables plus where each member runs, with clear errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kafila.planner.fleet import FleetError, parse_fleet
from ops.fleetfile import api_key, load, parse

ROOT = Path(__file__).resolve().parents[2]

BASE = """
[fleet]
name = "two"
image = "kafila/member:cpu"
session_host = "b"

[rendezvous]
ssh = "rdv"
address = "198.18.0.2"

[session]
model = "smollm2-135m"
context = 512

[[device]]
name = "a"
memory_gb = 4

[[device]]
name = "b"
memory_gb = 8

[[site]]
name = "home"
[[site.host]]
device = "a"
ssh = "ops@a.example"
runtime = "native"
venv = "~/kafila"
[[site]]
name = "office"
[[site.host]]
device = "b"
ssh = "b-host"
gpus = "none"
api = "0.0.0.0:11500"
args = ["--threads", "1", "--insecure-no-key"]
"""


def test_a_fleet_file_names_hosts_sites_and_puts_the_session_host_first() -> None:
    f = parse(BASE, "two.toml")
    assert f.name == "two" and f.image == "kafila/member:cpu"
    assert [h.device for h in f.hosts] == ["b", "a"]  # session host first
    assert [d.name for d in f.plan.devices] == ["b", "a"]  # the planner anchors on it too
    b, a = f.hosts
    assert (b.site, b.runtime, b.gpus, b.api, b.local_api, b.metrics_port) == (
        "office", "docker", "none", "0.0.0.0:11500", "127.0.0.1:11500", 9464,
    )  # fmt: skip
    assert b.metrics == "0.0.0.0:9464"  # `kafila host|join --metrics`, on the API's address
    assert b.args == ("--threads", "1", "--insecure-no-key")
    assert (a.runtime, a.python, a.os, a.api) == ("native", "~/kafila/bin/python", "linux", "127.0.0.1:11434")
    assert f.rendezvous.url == "ws://198.18.0.2:8470/v1/signal"
    assert f.rendezvous.host is not None and f.rendezvous.host.ssh == "rdv"


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            ('runtime = "native"', 'runtime = "podman"'),
            "'runtime' must be one of ['docker', 'native'], got 'podman'",
        ),
        (('ssh = "b-host"', 'shh = "b-host"'), "'shh': did you mean 'ssh'?"),
        (('device = "a"', 'device = "c"'), "device 'c' is not a [[device]] name; devices: ['b', 'a']"),
        (('session_host = "b"', 'session_host = "z"'), "session_host 'z' is not a [[device]] name"),
        (('name = "two"', 'name = "Two Fleet"'), "[fleet]: 'name' must be lower-case"),
        (('api = "0.0.0.0:11500"', 'api = "0.0.0.0:99999"'), "'api' must be HOST:PORT with a port 1-65535"),
        (
            ('"--insecure-no-key"]', '"--api-key-file", "/k"]'),
            'give the member\'s API keys as `api_key_file = "FILE"` in [fleet] or in its [[site]]',
        ),
        (
            ('name = "office"', 'name = "office"\napi_key_file = "k"'),
            "api_key_file and '--insecure-no-key' in 'args' contradict each other",
        ),
        (
            (', "--insecure-no-key"]', "]"),
            "api 0.0.0.0:11500 is open to other machines, which a member refuses without an API key",
        ),
        (
            ('address = "198.18.0.2"', ""),
            "'address' (where members reach the rendezvous 'rdv' starts) is missing",
        ),
        (('ssh = "rdv"', 'url = "ws://x:1/v1/signal"\nssh = "rdv"'), "give exactly one of `url`"),
        (
            ('venv = "~/kafila"', 'venv = "~/kafila"\npython = "/usr/bin/python3"'),
            "give 'python' (an interpreter) or 'venv' (its environment), not both",
        ),
        (('runtime = "native"', 'runtime = "docker"\nos = "macos"'), "macOS members run natively"),
        (('device = "b"', 'device = "a"'), "a device runs on one host only, given twice: ['a']"),
        (
            ('args = ["--threads", "1", "--insecure-no-key"]', "args = [1]"),
            "'args' must be a list of strings",
        ),
    ],
)
def test_mistakes_are_named_with_the_site_host_and_field(change: tuple[str, str], message: str) -> None:
    with pytest.raises(FleetError) as err:
        parse(BASE.replace(*change, 1), "two.toml")
    assert message in str(err.value)
    assert str(err.value).startswith("two.toml")


KEY = "k" * 16 + "-first"


def keyed(tmp_path: Path, text: str) -> Path:
    """BASE with keys: [fleet]'s for every site, the office site's own, a keyed open API."""
    (tmp_path / "keys").mkdir()
    (tmp_path / "keys" / "fleet.key").write_text(f"# the fleet's\n\n{KEY}\n{'x' * 20}\n")
    (tmp_path / "office.key").write_text("o" * 24 + "\n")
    path = tmp_path / "two.toml"
    path.write_text(text)
    return path


def test_an_api_key_file_per_fleet_or_site_is_read_relative_to_the_fleet_file(tmp_path: Path) -> None:
    text = (
        BASE.replace('session_host = "b"', 'session_host = "b"\napi_key_file = "keys/fleet.key"')
        .replace('name = "office"', 'name = "office"\napi_key_file = "office.key"')
        .replace(', "--insecure-no-key"]', "]")  # an open API with a key: allowed
    )
    f = load(keyed(tmp_path, text))
    b, a = f.hosts
    assert a.api_key_file == str(tmp_path / "keys" / "fleet.key")
    assert b.api_key_file == str(tmp_path / "office.key")  # the site's own
    assert api_key(a) == KEY  # the first key, past comments and blank lines
    assert api_key(b) == "o" * 24
    assert parse(BASE, "two.toml").hosts[0].api_key_file is None


@pytest.mark.parametrize(
    ("key_text", "message"),
    [
        ("short\n", "an API key must be at least 16 characters"),
        ("# nothing\n", "holds no key"),
        (None, "cannot read it"),
    ],
)
def test_a_bad_key_file_is_named_when_the_fleet_is_loaded(
    tmp_path: Path, key_text: str | None, message: str
) -> None:
    path = keyed(tmp_path, BASE.replace('name = "office"', 'name = "office"\napi_key_file = "bad.key"'))
    if key_text is not None:
        (tmp_path / "bad.key").write_text(key_text)
    path.write_text(path.read_text().replace(', "--insecure-no-key"]', "]"))
    with pytest.raises(FleetError) as err:
        load(path)
    assert message in str(err.value) and "site 'office' (b): api_key_file" in str(err.value)


def test_with_a_key_the_metrics_need_a_port_of_their_own() -> None:
    text = BASE.replace('name = "office"', 'name = "office"\napi_key_file = "k"').replace(
        'args = ["--threads", "1", "--insecure-no-key"]', "metrics_port = 11500"
    )
    with pytest.raises(FleetError, match="'metrics_port' must differ from the API's port"):
        parse(text, "two.toml")


def test_a_device_no_host_runs_is_named() -> None:
    text = BASE + '\n[[device]]\nname = "c"\nmemory_gb = 1\n'
    with pytest.raises(FleetError, match=r"no \[\[site.host\]\] runs device\(s\) \['c'\]"):
        parse(text, "two.toml")


def test_the_planner_reads_the_same_file_and_checks_the_ops_tables_shape() -> None:
    fleet = parse_fleet(BASE, "two.toml")
    assert [d.name for d in fleet.devices] == ["b", "a"]
    with pytest.raises(FleetError, match=r"'site' must be a \[\[site\]\] table"):
        parse_fleet(
            'site = 3\n[session]\nmodel = "m"\ncontext = 1\n[[device]]\nname = "a"\nmemory_gb = 1\n', "t"
        )
    with pytest.raises(FleetError, match=r"unknown top-level key\(s\) \['fleets'\]"):
        parse_fleet(BASE.replace("[fleet]", "[fleets]"), "t")


@pytest.mark.parametrize("name", ["lan", "uscentral", "intercontinental", "lab"])
def test_the_shipped_fleets_parse_and_kafila_plan_reads_them(name: str) -> None:
    path = ROOT / "fleets" / f"{name}.toml"
    f = load(path)
    assert len(f.hosts) == len(f.plan.devices)
    if name != "lab":  # the lab's model is the default one, planned the same way; one run is enough
        return
    out = subprocess.run(
        [sys.executable, "-m", "kafila", "plan", str(path), "--json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["divisions"]["kafila"]["feasible"] is True


def test_weights_name_a_folder_on_the_session_host_and_a_preset_model_needs_them() -> None:
    preset = BASE.replace('model = "smollm2-135m"', 'model = "qwen3-8b"')
    with pytest.raises(FleetError) as err:
        parse(preset, "two.toml")
    assert str(err.value).startswith("two.toml: [fleet]: [session] model 'qwen3-8b' is a planning preset")
    assert "on the session host 'b'" in str(err.value) and "Qwen/Qwen3-8B" in str(err.value)
    for given, kept in (("/srv/models/Qwen3-8B/", "/srv/models/Qwen3-8B"), ("~/models/q", "~/models/q")):
        fleet = parse(preset.replace('session_host = "b"', f'session_host = "b"\nweights = "{given}"'))
        assert fleet.weights == kept
    assert parse(BASE).weights is None  # the default model ships in a package
    hub = parse(
        preset.replace('session_host = "b"', 'session_host = "b"\nweights = "https://hf.co/Qwen/Qwen3-8B/"')
    )
    assert (
        hub.weights == hub.weights_url == "https://hf.co/Qwen/Qwen3-8B"
    )  # the host fetches qwen3-8b from it


def test_weights_may_name_a_gguf_file_on_the_session_host() -> None:
    preset = BASE.replace('model = "smollm2-135m"', 'model = "qwen3-8b"')
    for given in ("/srv/models/Qwen3-8B-Q4_K_M.gguf", "~/models/q8.GGUF"):
        fleet = parse(preset.replace('session_host = "b"', f'session_host = "b"\nweights = "{given}"'))
        assert fleet.weights == fleet.weights_gguf == given and fleet.weights_url is None
    folder = parse(
        preset.replace('session_host = "b"', 'session_host = "b"\nweights = "/srv/models/q.gguf.d"')
    )
    assert folder.weights == "/srv/models/q.gguf.d" and folder.weights_gguf is None  # a folder


@pytest.mark.parametrize(
    ("weights", "message"),
    [
        ("ftp://mirror.example/Qwen3-8B", "not an http:// or https:// URL"),
        (
            "models/Qwen3-8B",
            "(or a .gguf file's), absolute or ~/ (the ssh user's home), got 'models/Qwen3-8B'",
        ),
        ("/srv/model.safetensors", "names a file: give the model's folder (config.json, *.safetensors"),
        ("/srv/pytorch_model.BIN", "or a .gguf file, which `kafila host` converts in place"),
        ("~/models/q/config.json", "'weights' '~/models/q/config.json' names a file"),
        ("srv/q8.gguf", "'weights' must be the model folder's path on the session host 'b' (or a .gguf"),
        ("/srv/a:b", "cannot hold ':'"),
        ("", "'weights' must be a non-empty string"),
    ],
)
def test_weights_that_the_session_host_cannot_load_are_refused_by_name(weights: str, message: str) -> None:
    text = BASE.replace('session_host = "b"', f'session_host = "b"\nweights = "{weights}"')
    with pytest.raises(FleetError) as err:
        parse(text, "two.toml")
    assert str(err.value).startswith("two.toml: [fleet]: ")
    assert message in str(err.value)
