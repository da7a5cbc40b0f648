"""`kafila plan`: the table, the --json schema, refusals and errors, through the real CLI entry."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from kafila.cli import main
from kafila.models.config import ModelConfig
from kafila.models.manifest import specs_from_config

FLEETS = Path(__file__).resolve().parents[2] / "examples" / "fleets"
KEYS = {
    "feasible", "reason", "order", "head", "blocks", "stage_ms", "bottleneck_ms",
    "imbalance", "utilisation", "circuit_ms", "tier",
}  # fmt: skip


def test_json_schema_for_all_divisions(capsys):
    rc = main(["plan", str(FLEETS / "intercontinental.toml"), "--json"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and set(out) == {"divisions"}
    divisions = out["divisions"]
    assert set(divisions) == {"kafila", "uniform", "memory"}
    for entry in divisions.values():
        assert set(entry) >= KEYS
    kafila, uniform = divisions["kafila"], divisions["uniform"]
    assert kafila["feasible"] and sum(kafila["blocks"].values()) == 64
    assert kafila["bottleneck_ms"] == max(kafila["stage_ms"].values())
    assert not uniform["feasible"] and uniform["reason"].startswith("m3pro: 13 blocks need 21.4 GB")


def test_table_compares_divisions_and_explains_refusals(capsys):
    rc = main(["plan", str(FLEETS / "lan.toml"), "--model", "qwen3-14b"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "kafila    yes" in out and "uniform   NO" in out
    assert "refused:\n  uniform: a40: 10 blocks need 13.3 GB, has 12.0 GB" in out


def test_overrides_and_a_single_refused_division_exit_1(capsys):
    rc = main(["plan", str(FLEETS / "lan.toml"), "--model", "qwen3-32b", "--division", "kafila", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 1 and list(out["divisions"]) == ["kafila"]
    assert "at most 44 of 64 blocks" in out["divisions"]["kafila"]["reason"]
    rc = main(["plan", str(FLEETS / "lan.toml"), "--context", "2048", "--concurrency", "1", "--json"])
    assert rc == 0 and json.loads(capsys.readouterr().out)["divisions"]["uniform"]["feasible"]


def test_bad_fleet_is_reported_with_the_field(tmp_path, capsys):
    bad = tmp_path / "bad.toml"
    bad.write_text('[session]\nmodel="qwen3-8b"\ncontext=10\n[[device]]\nname="x"\nmemory_gb="lots"\n')
    assert main(["plan", str(bad)]) == 2
    assert "device 'x': 'memory_gb' must be a finite number" in capsys.readouterr().err
    assert main(["plan", str(FLEETS / "lan.toml"), "--model", "nope"]) == 2
    assert "neither a preset" in capsys.readouterr().err


TWO = (
    '[session]\nmodel = "qwen3-8b"\ncontext = 4096\n'
    '[[device]]\nname = "a"\nmemory_gb = 24\nbandwidth_gb_s = 500\nrtt_ms = 10\n'
    '[[device]]\nname = "b"\nmemory_gb = 24\nbandwidth_gb_s = 500\nrtt_ms = 12\n'
)


def test_non_finite_numbers_and_malformed_probe_files_are_named_errors(tmp_path, capsys):
    """inf and 1e300 overflowed (OverflowError tracebacks), an inf bandwidth priced blocks at 0 s
    ("per-block costs must be > 0"), a malformed probe file raised AttributeError or named no file."""
    (tmp_path / "p.json").write_text('{"device": {"memory_bytes": 24000000000}, "probe": "x"}')
    (tmp_path / "lots.json").write_text('{"device": {"memory_bytes": "lots"}}')
    cases = [
        (
            ("memory_gb = 24\nbandwidth", "memory_gb = inf\nbandwidth"),
            "device 'a': 'memory_gb' must be a finite",
        ),
        (("memory_gb = 24\nbandwidth", "memory_gb = 1e300\nbandwidth"), "device 'a': 'memory_gb' must be a"),
        (("rtt_ms = 10", "rtt_ms = inf"), "device 'a': 'rtt_ms' must be a finite number >= 0"),
        (
            ("bandwidth_gb_s = 500\nrtt_ms = 12", "bandwidth_gb_s = inf\nrtt_ms = 12"),
            "device 'b': 'bandwidth_gb_s'",
        ),
        (
            ("rtt_ms = 12", 'rtt_ms = 12\nprobe = "p.json"'),
            "device 'b': probe file 'p.json': 'probe' must be",
        ),
        (
            ("rtt_ms = 12", 'rtt_ms = 12\nprobe = "lots.json"'),
            "device 'b': probe file 'lots.json': 'memory_bytes'",
        ),
    ]
    for (old, new), message in cases:
        assert old in TWO
        (tmp_path / "f.toml").write_text(TWO.replace(old, new))
        assert main(["plan", str(tmp_path / "f.toml")]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"kafila plan: {tmp_path / 'f.toml'}: ") and message in err, err


def test_a_fleet_file_that_is_not_utf8_is_named(tmp_path, capsys):
    """It was read outside parse_fleet, so the decode error named no file."""
    (tmp_path / "bad.toml").write_bytes(b"\xff\xfe")
    assert main(["plan", str(tmp_path / "bad.toml")]) == 2
    assert capsys.readouterr().err == (
        f"kafila plan: {tmp_path / 'bad.toml'}: not valid TOML: "
        "'utf-8' codec can't decode byte 0xff in position 0: invalid start byte\n"
    )


def test_missing_fleet_and_probe_files_are_named_once_with_the_reason(tmp_path, capsys):
    """The errno and the path came twice: "kafila plan: [Errno 2] No such file or directory: 'f'"."""
    assert main(["plan", str(tmp_path / "none.toml")]) == 2
    assert capsys.readouterr().err == f"kafila plan: {tmp_path / 'none.toml'}: No such file or directory\n"
    (tmp_path / "f.toml").write_text(TWO.replace("rtt_ms = 12", 'rtt_ms = 12\nprobe = "gone.json"'))
    assert main(["plan", str(tmp_path / "f.toml")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"kafila plan: {tmp_path / 'f.toml'}: device 'b': ") and err.endswith(
        ": cannot read probe file 'gone.json': No such file or directory\n"
    )


def test_fleet_and_probe_files_nested_too_deeply_are_named_errors(tmp_path, capsys):
    """json and tomllib recurse into nested arrays: a deep file was a RecursionError traceback, exit 1."""
    (tmp_path / "deep.json").write_text("[" * 100_000)
    (tmp_path / "f.toml").write_text(TWO.replace("rtt_ms = 12", 'rtt_ms = 12\nprobe = "deep.json"'))
    assert main(["plan", str(tmp_path / "f.toml")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"kafila plan: {tmp_path / 'f.toml'}: device 'b': ") and err.endswith(
        ": cannot read probe file 'deep.json': nested too deeply\n"
    )
    (tmp_path / "f.toml").write_text("a = " + "[" * 100_000 + "]" * 100_000 + "\n" + TWO)
    assert main(["plan", str(tmp_path / "f.toml")]) == 2
    assert (
        capsys.readouterr().err == f"kafila plan: {tmp_path / 'f.toml'}: not valid TOML: nested too deeply\n"
    )


def test_context_and_concurrency_below_1_are_refused_not_replaced_by_the_fleet(tmp_path, capsys):
    (tmp_path / "f.toml").write_text(TWO)
    for flag in ("--context", "--concurrency"):
        with pytest.raises(SystemExit) as exit_:
            main(["plan", str(tmp_path / "f.toml"), flag, "0"])
        assert (
            exit_.value.code == 2
            and f"argument {flag}: must be a whole number >= 1" in capsys.readouterr().err
        )
    with pytest.raises(SystemExit):
        main(["plan", str(tmp_path / "f.toml"), "--concurrency", str(2**32)])  # past the wire's 32 bits
    assert "argument --concurrency: must be at most 4294967295" in capsys.readouterr().err
    assert main(["plan", str(tmp_path / "f.toml"), "--context", "40961"]) == 2  # as `kafila host` refuses it
    assert "--context 40961 is beyond the 40960 positions qwen3-8b" in capsys.readouterr().err
    (tmp_path / "f.toml").write_text(TWO.replace("context = 4096", "context = 100000000"))
    assert main(["plan", str(tmp_path / "f.toml")]) == 2
    assert "f.toml: [session] context 100000000 is beyond the 40960 positions" in capsys.readouterr().err
    assert main(["plan", str(tmp_path / "f.toml"), "--context", "4096"]) == 0  # the flag overrides it


def test_a_plan_without_times_shows_a_bare_dash_for_utilisation(tmp_path, capsys):
    (tmp_path / "f.toml").write_text(TWO.replace("memory_gb = 24", "memory_gb = 0.5"))
    assert main(["plan", str(tmp_path / "f.toml")]) == 1
    out = capsys.readouterr().out
    assert "-%" not in out
    row = next(line for line in out.splitlines() if line.startswith("kafila "))
    assert row.split()[:6] == ["kafila", "NO", "-", "-", "-", "-"], row  # division fits head bneck imbal util


def write_folder(folder: Path, n_layers: int) -> Path:
    """A Hugging Face folder (config.json + model.safetensors of zeros) written with the stdlib."""
    config = {
        "model_type": "qwen3", "hidden_size": 64, "num_hidden_layers": n_layers,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
        "intermediate_size": 96, "vocab_size": 256, "tie_word_embeddings": False,
        "max_position_embeddings": 40960,
    }  # fmt: skip
    specs = specs_from_config(ModelConfig.from_dict(config), "F32")
    header, offset = {}, 0
    for s in specs:
        header[s.name] = {
            "dtype": s.dtype,
            "shape": list(s.shape),
            "data_offsets": [offset, offset + s.nbytes()],
        }
        offset += s.nbytes()
    blob = json.dumps(header).encode()
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "model.safetensors").write_bytes(struct.pack("<Q", len(blob)) + blob + bytes(offset))
    return folder


def test_local_hugging_face_folder_as_model(tmp_path, capsys):
    folder = write_folder(tmp_path / "tiny-qwen3", 5)
    rc = main(
        ["plan", str(FLEETS / "uscentral.toml"), "--model", str(folder), "--json", "--division", "kafila"]
    )
    out = json.loads(capsys.readouterr().out)["divisions"]["kafila"]
    assert rc == 0 and sum(out["blocks"].values()) == 5


def test_devices_filled_from_kafila_probe_json_files(tmp_path, capsys):
    probe_json = {
        "probe": {"block_model": "smollm2-135m"},
        "device": {
            "name": "whatever", "memory_bytes": 8 * 10**9, "bandwidth_bytes_s": 20e9,
            "overhead_s": 1e-4, "flops": 1e11, "block_s": 0.004,
        },
    }  # fmt: skip
    (tmp_path / "box.json").write_text(json.dumps(probe_json))
    (tmp_path / "fleet.toml").write_text(
        '[session]\nmodel = "smollm2-135m"\ncontext = 512\nconcurrency = 1\n'
        '[[device]]\nname = "box"\nprobe = "box.json"\nnat = "ordinary"\n'
        '[[device]]\nname = "box2"\nprobe = "box.json"\nbandwidth_gb_s = 40\n'
    )
    assert main(["plan", str(tmp_path / "fleet.toml"), "--json", "--division", "kafila"]) == 0
    out = json.loads(capsys.readouterr().out)["divisions"]["kafila"]
    # box is priced by its probed block time (4 ms), box2 by its explicit 40 GB/s (0.18 ms a block)
    assert out["tier"] == "full" and out["stage_ms"]["box"] >= 4.0 and out["blocks"]["box2"] > 20
    assert main(["plan", str(tmp_path / "fleet.toml"), "--json", "--model", "qwen3-8b"]) == 1
    out = json.loads(capsys.readouterr().out)["divisions"]["kafila"]
    assert "at most" in out["reason"]  # 16 GB of members for a 16.4 GB model, block_s dropped


def test_objective_flag_chooses_what_the_kafila_division_minimizes(capsys):
    args = ["plan", str(FLEETS / "lan.toml"), "--concurrency", "1", "--division", "kafila", "--json"]
    assert main(args) == 0
    load = json.loads(capsys.readouterr().out)["divisions"]["kafila"]
    assert main([*args, "--objective", "bottleneck"]) == 0
    paper = json.loads(capsys.readouterr().out)["divisions"]["kafila"]
    assert load["circuit_ms"] < paper["circuit_ms"] and load["bottleneck_ms"] > paper["bottleneck_ms"]
    assert load["per_token_ms"] == load["circuit_ms"]  # one request waits for the whole circuit
    assert main(["plan", str(FLEETS / "lan.toml"), "--concurrency", "1"]) == 0
    assert "note: 1 request in flight cannot keep 4 stages busy" in capsys.readouterr().out


def test_host_flags_carry_the_objective_into_the_session_options():
    import argparse

    from kafila.cli.host import configure, options

    parser = argparse.ArgumentParser()
    configure(parser)
    assert options(parser.parse_args([])).objective == "load"  # type: ignore[attr-defined]
    o = options(parser.parse_args(["--objective", "bottleneck", "--concurrency", "4"]))
    assert (o.objective, o.concurrency) == ("bottleneck", 4)  # type: ignore[attr-defined]


def test_a_packed_format_fits_a_model_the_fleet_cannot_hold_in_bf16(capsys):
    """qwen3-32b does not fit the LAN fleet in bf16 (see above); in q4 its blocks weigh 0.625/2 as
    much and the plan is feasible, priced in the packed bytes."""
    args = ["plan", str(FLEETS / "lan.toml"), "--model", "qwen3-32b", "--division", "kafila", "--json"]
    assert main([*args, "--quant", "none"]) == 1
    capsys.readouterr()
    assert main([*args, "--quant", "q4"]) == 0
    plan = json.loads(capsys.readouterr().out)["divisions"]["kafila"]
    assert plan["feasible"] and sum(plan["blocks"].values()) == 64
