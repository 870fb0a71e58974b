"""`punica` refuses wrong arguments with one line and exit code 2 before anything loads or runs
(the loaders are replaced by ones that fail the test if called), and tells its version."""

import argparse
import importlib.metadata
import socket

import pytest

import punica.cluster.report
import punica.llm
import punica.server.serve
from punica.cli import main
from punica.config import EngineArgs
from punica.flags import add_arguments


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def must_not_run(what: str):
    def fail(*args, **kwargs):
        raise AssertionError(f"{what} ran although the arguments are wrong")
    return fail


@pytest.fixture()
def no_model(monkeypatch):
    """Loading a model (punica generate's engine, punica serve's engine or Ray workers) fails the test."""
    monkeypatch.setattr(punica.llm, "build_engine", must_not_run("the engine build"))
    monkeypatch.setattr(punica.server.serve, "build_state", must_not_run("the server's model load"))


def error_line(capsys) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count("\n") == 1, err
    return err.strip()


def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out == f"punica {importlib.metadata.version('punica')}\n"


@pytest.mark.parametrize("extra", [[], ["--workers", "2"]])
def test_serve_on_a_busy_port_fails_before_loading(no_model, capsys, extra):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert main(["serve", "--port", str(port), *extra]) == 2
    assert error_line(capsys) == (f"punica: error: cannot listen on 127.0.0.1:{port}: Address already in use "
                                  "(choose another --port or --host)")


@pytest.mark.parametrize("args, message", [
    (["--port", "70000"], "port must be in [0, 65535], got 70000"),
    (["--host", "no-such-host.invalid"], "--host 'no-such-host.invalid': "),
])
def test_serve_on_a_wrong_address_fails_before_loading(no_model, capsys, args, message):
    assert main(["serve", *args]) == 2
    assert error_line(capsys).startswith(f"punica: error: {message}")


def test_serve_binds_before_loading_and_releases_the_port_when_loading_fails(monkeypatch):
    port = free_port()
    bound = []

    def load(*args, **kwargs):
        with socket.socket() as other, pytest.raises(OSError):
            other.bind(("127.0.0.1", port))  # held by the server while its model loads
        bound.append(port)
        raise ValueError("no model here")

    monkeypatch.setattr(punica.server.serve, "build_state", load)
    assert main(["serve", "--port", str(port)]) == 2
    assert bound == [port]
    with socket.socket() as again:
        again.bind(("127.0.0.1", port))


@pytest.mark.parametrize("args, message", [
    (["--use", "nosuch"], "--use 'nosuch' names no adapter being served (served: signature, json, pirate)"),
    (["--use", "nosuch", "--adapter", "mine=/adapters/mine"],
     "--use 'nosuch' names no adapter being served (served: mine)"),
    (["--use", "pirate", "--model", "/models/llama"], "--use 'pirate' names no adapter being served (served: none)"),
    (["--adapter", "oops"], "--adapter expects NAME=PATH, got 'oops'"),
    (["--json-schema", "/no/such/schema.json"], "--json-schema: cannot read /no/such/schema.json: No such file"),
    (["--max-tokens", "0"], "max_tokens must be"),
])
def test_generate_checks_its_arguments_before_loading(no_model, capsys, args, message):
    assert main(["generate", "--prompt", "Hi", *args]) == 2
    assert error_line(capsys).startswith(f"punica: error: {message}")


@pytest.mark.parametrize("schema, message", [
    ('{"type": "objectx"}', 'is not accepted by the grammar engine: Unsupported type "objectx"'),
    ('{"type": ', "is not valid JSON"),
    ("[1, 2]", "must be a JSON schema"),
])
def test_generate_checks_the_json_schema_before_loading(no_model, capsys, tmp_path, schema, message):
    path = tmp_path / "schema.json"
    path.write_text(schema)
    assert main(["generate", "--prompt", "Hi", "--json-schema", str(path)]) == 2
    line = error_line(capsys)
    assert line.startswith(f"punica: error: --json-schema {path}: ") and message in line


@pytest.mark.parametrize("flag, value, message", [
    ("--gpus", "0", "must be >= 1, got 0"),
    ("--gpus", "two", "invalid int value: 'two'"),
    ("--requests", "-5", "must be >= 1, got -5"),
    ("--requests", "0", "must be >= 1, got 0"),
    ("--duration", "-1", "must be > 0, got -1"),
    ("--duration", "0", "must be > 0, got 0"),
    ("--duration", "inf", "must be > 0, got inf"),
    ("--duration", "nan", "must be > 0, got nan"),
    ("--zipf-alpha", "0", "must be > 0, got 0"),
    ("--zipf-alpha", "-1.5", "must be > 0, got -1.5"),
    ("--kv-tokens", "0", "must be >= 1, got 0"),
    ("--max-total", "1", "must be >= 2, got 1"),
    ("--adapters", "0", "must be >= 1, got 0"),
    ("--max-batch-size", "0", "must be >= 1, got 0"),
    ("--light-load-batch", "0", "must be >= 1, got 0"),
    ("--idle-release-s", "-1", "must be >= 0, got -1"),
    ("--max-loras", "0", "must be >= 1, got 0"),
    ("--host-tier-adapters", "0", "must be >= 1, got 0"),
    ("--max-gpus-per-adapter", "0", "must be >= 1, got 0"),
    ("--max-packed-kv-tokens", "0", "must be >= 1, got 0"),
    ("--gpu-startup-s", "-1", "must be >= 0, got -1"),
])
def test_simulate_refuses_nonsense_values_naming_the_flag(monkeypatch, capsys, tmp_path, flag, value, message):
    monkeypatch.setattr(punica.cluster.report, "simulate", must_not_run("the simulation"))
    with pytest.raises(SystemExit) as e:
        main(["simulate", "--out", str(tmp_path), f"{flag}={value}"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert err.strip().splitlines()[-1] == f"punica simulate: error: argument {flag}: {message}"


@pytest.mark.parametrize("args, message", [
    (["--light-load-batch", "40", "--max-batch-size", "32"], "--light-load-batch 40 is over --max-batch-size 32"),
    (["--max-total", "4096", "--kv-tokens", "2048"], "--max-total 4096 is over --kv-tokens 2048"),
])
def test_simulate_refuses_flags_that_contradict_each_other(monkeypatch, capsys, tmp_path, args, message):
    monkeypatch.setattr(punica.cluster.report, "simulate", must_not_run("the simulation"))
    assert main(["simulate", "--out", str(tmp_path), *args]) == 2
    assert error_line(capsys).startswith(f"punica: error: {message}")


def test_simulate_refuses_an_out_that_is_a_file(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(punica.cluster.report, "simulate", must_not_run("the simulation"))
    (tmp_path / "file").write_text("")
    assert main(["simulate", "--out", str(tmp_path / "file")]) == 2
    assert error_line(capsys) == f"punica: error: --out {tmp_path / 'file'} is a file, not a directory"


@pytest.mark.parametrize("value, message", [
    ("4X", "invalid size '4X': bytes as an integer, or a number with a unit"),
    ("0", "must be >= 1 byte, got 0"),
    ("-2G", "invalid size '-2G'"),
])
def test_serve_refuses_a_wrong_size_in_bytes_naming_the_flag(no_model, capsys, value, message):
    with pytest.raises(SystemExit) as e:
        main(["serve", f"--lora-host-bytes={value}"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "--lora-host-bytes" in err and message in err, err


@pytest.mark.parametrize("value, size", [
    ("34359738368", 34359738368), ("32G", 32 << 30), ("32gib", 32 << 30), ("32Gi", 32 << 30),
    ("32GB", 32 * 10**9), ("1.5G", 3 << 29), ("512M", 512 << 20), ("4k", 4096), ("4KB", 4000), ("1T", 1 << 40),
])
def test_sizes_in_bytes_take_units(value, size):
    parser = argparse.ArgumentParser()
    add_arguments(parser, EngineArgs, only=("lora_host_bytes", "max_lora_bytes", "kv_cache_bytes"))
    args = parser.parse_args(["--lora-host-bytes", value, "--max-lora-bytes", value, "--kv-cache-bytes", value])
    assert args.lora_host_bytes == args.max_lora_bytes == args.kv_cache_bytes == size
