"""Configuration parsing, clamps, errors, masking, the `config` command and the docs table."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from devtools import configdoc
from service import config
from service.cli import main
from service.kit.dsn import mask_dsn

P = config.PREFIX
DOCS = Path(__file__).parent.parent.parent / "docs" / "configuration.md"


def test_defaults_are_safe() -> None:
    s = config.load({})
    assert (s.enabled, s.dry_run, s.mode) == (False, True, "disabled")
    assert s.threshold_s == 300.0
    assert s.deletes_per_minute == 120
    assert s.reconcile_timeout_s == 45.0
    assert s.kube.namespaces == ("sandboxes",)
    assert s.kube.label_selector == "app.kubernetes.io/managed-by=space-sandbox"
    assert s.kube.label_keys.generation == "space.generation"
    assert s.database.notify_channel == "sandbox_execution_changed"
    assert s.leader.enabled is True
    assert s.warnings == ()


@pytest.mark.parametrize("raw", ["1", "true", "TRUE", "yes", "On", " y ", "t"])
def test_booleans_accept_the_usual_true_spellings(raw: str) -> None:
    assert config.load({P + "ENABLED": raw}).enabled is True


@pytest.mark.parametrize("raw", ["0", "false", "No", "off", "n", "F"])
def test_booleans_accept_the_usual_false_spellings(raw: str) -> None:
    assert config.load({P + "DRY_RUN": raw}).dry_run is False


@pytest.mark.parametrize("raw", ["2", "enabled", "truthy", "nope", "-"])
def test_booleans_reject_anything_else(raw: str) -> None:
    with pytest.raises(config.ConfigError) as err:
        config.load({P + "ENABLED": raw})
    assert err.value.variable == P + "ENABLED"


@pytest.mark.parametrize(
    ("suffix", "raw"),
    [
        ("THRESHOLD_SECONDS", "abc"),
        ("THRESHOLD_SECONDS", "nan"),
        ("DELETES_PER_MINUTE", "1.5"),
        ("WORKERS", "four"),
        ("NAMESPACE", "Not_A_Namespace"),
        ("NAMESPACES", "a,Not_A_Namespace"),
        ("NAMESPACES", "a,,b"),
        ("NAMESPACES", "a,b,a"),
        ("NAMESPACES", ",".join(f"ns{i}" for i in range(config.MAX_NAMESPACES + 1))),
        ("NOTIFY_CHANNEL", "bad-channel; drop table"),
        ("METRICS_BIND_ADDRESS", "localhost"),
        ("METRICS_BIND_ADDRESS", "0.0.0.0:99999"),
        ("LABEL_SELECTOR", "=broken"),
        ("LOG_FORMAT", "xml"),
        ("DELETE_GRACE_PERIOD_SECONDS", "soon"),
    ],
)
def test_unparsable_values_name_the_variable(suffix: str, raw: str) -> None:
    with pytest.raises(config.ConfigError) as err:
        config.load({P + suffix: raw})
    assert err.value.variable == P + suffix
    assert str(err.value).startswith(P + suffix)
    assert "\n" not in str(err.value)


def test_namespaces_lists_several_sandbox_namespaces_in_order() -> None:
    s = config.load({P + "NAMESPACES": " tenant-a, tenant-b ,tenant-c"})
    assert s.kube.namespaces == ("tenant-a", "tenant-b", "tenant-c")
    assert s.warnings == ()
    shown = {name: value for name, value, _ in config.effective(s, {})}
    assert shown[P + "NAMESPACES"] == "tenant-a,tenant-b,tenant-c"


def test_the_single_namespace_setting_keeps_working() -> None:
    assert config.load({P + "NAMESPACE": "tenant-a"}).kube.namespaces == ("tenant-a",)
    # An empty list means "not set": the one NAMESPACE (or its default) is used.
    assert config.load({P + "NAMESPACES": " "}).kube.namespaces == ("sandboxes",)
    s = config.load({P + "NAMESPACES": "tenant-a", P + "NAMESPACE": ""})
    assert s.kube.namespaces == ("tenant-a",)


def test_namespace_and_namespaces_both_set_is_an_error_naming_the_list() -> None:
    with pytest.raises(config.ConfigError) as err:
        config.load({P + "NAMESPACE": "tenant-a", P + "NAMESPACES": "tenant-a,tenant-b"})
    assert err.value.variable == P + "NAMESPACES"
    assert P + "NAMESPACE" in str(err.value).removeprefix(P + "NAMESPACES")


def test_out_of_range_numbers_are_clamped_with_a_warning() -> None:
    s = config.load({P + "THRESHOLD_SECONDS": "0", P + "DELETES_PER_MINUTE": "100000"})
    assert s.threshold_s == 1.0
    assert s.deletes_per_minute == 6000
    assert isinstance(s.deletes_per_minute, int)
    joined = "\n".join(s.warnings)
    assert f"{P}THRESHOLD_SECONDS='0'" in joined and "using 1.0" in joined
    assert f"{P}DELETES_PER_MINUTE='100000'" in joined and "using 6000" in joined


def test_in_range_values_pass_through_without_warning() -> None:
    s = config.load({P + "THRESHOLD_SECONDS": "12.5", P + "WORKERS": "8"})
    assert (s.threshold_s, s.workers, s.warnings) == (12.5, 8, ())


def test_lease_timings_are_kept_ordered() -> None:
    s = config.load(
        {
            P + "LEASE_DURATION_SECONDS": "6",
            P + "RENEW_DEADLINE_SECONDS": "9",
            P + "RETRY_PERIOD_SECONDS": "5",
        }
    )
    assert s.leader.retry_period_s < s.leader.renew_deadline_s < s.leader.lease_duration_s
    assert len(s.warnings) == 2


def test_unknown_prefixed_variables_warn() -> None:
    s = config.load({P + "THRESHOLD_SECOND": "5"})
    assert any("THRESHOLD_SECOND is not a known variable" in w for w in s.warnings)


def test_database_url_from_a_file(tmp_path: Path) -> None:
    secret = tmp_path / "url"
    secret.write_text("postgresql://gc:s3cret@db:5432/app\n")
    s = config.load({P + "DATABASE_URL_FILE": str(secret)})
    assert s.database.url == "postgresql://gc:s3cret@db:5432/app"
    assert "s3cret" not in repr(s)
    assert "s3cret" not in s.database.masked_url


def test_database_url_file_errors_name_the_variable(tmp_path: Path) -> None:
    with pytest.raises(config.ConfigError) as err:
        config.load({P + "DATABASE_URL_FILE": str(tmp_path / "missing")})
    assert err.value.variable == P + "DATABASE_URL_FILE"
    with pytest.raises(config.ConfigError):
        config.load({P + "DATABASE_URL_FILE": str(tmp_path), P + "DATABASE_URL": "postgresql://x"})


@pytest.mark.parametrize(
    ("url", "secret"),
    [
        ("postgresql://gc:p%40ss@db:5432/app?sslmode=require", "p%40ss"),
        ("postgres://gc:hunter2@[::1]:5432/app", "hunter2"),
        ("postgresql://db/app?user=gc&password=hunter2", "hunter2"),
        ("host=db user=gc password=hunter2 dbname=app", "hunter2"),
        ("host=db password='hunter 2' dbname=app", "hunter 2"),
    ],
)
def test_mask_dsn_hides_passwords(url: str, secret: str) -> None:
    masked = mask_dsn(url)
    assert secret not in masked
    assert "***" in masked


def test_config_command_prints_effective_configuration(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(P + "THRESHOLD_SECONDS", "30")
    monkeypatch.setenv(P + "DATABASE_URL", "postgresql://gc:topsecret@db/app")
    assert main(["config"]) == 0
    out = capsys.readouterr().out
    assert re.search(rf"{P}THRESHOLD_SECONDS\s+30.0\s+\(env\)", out)
    assert re.search(rf"{P}DELETES_PER_MINUTE\s+120\s+\(default\)", out)
    assert "topsecret" not in out
    assert len([line for line in out.splitlines() if line.startswith(P)]) == len(config.VARIABLES)


def test_config_command_exits_2_with_one_line_naming_the_variable() -> None:
    env = {"PATH": "/usr/bin:/bin", P + "THRESHOLD_SECONDS": "abc"}
    proc = subprocess.run(
        [sys.executable, "-m", "service.cli", "config"],
        env=env,
        capture_output=True,
        text=True,
        check=False,
        cwd=Path(__file__).parent.parent.parent,
    )
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert f"{P}THRESHOLD_SECONDS" in lines[0]
    assert "Traceback" not in proc.stderr


def test_docs_and_code_agree_on_the_variables_and_defaults() -> None:
    text = DOCS.read_text()
    documented = dict(re.findall(r"^\| `([A-Z_]+)` \| `([^`]*)` \|", text, flags=re.MULTILINE))
    assert set(documented) == {v.suffix for v in config.VARIABLES}
    for var in config.VARIABLES:
        default = var.default
        if isinstance(default, bool):
            shown = str(default).lower()
        elif isinstance(default, tuple) and default:
            shown = f"{default[0]}:{default[1]}"
        elif default is None or default in ("", ()):
            shown = "(empty)"
        else:
            shown = str(default)
        assert documented[var.suffix] == shown, var.suffix


def test_the_docs_table_is_exactly_the_one_the_declarations_write() -> None:
    assert configdoc.documented_table(DOCS.read_text()) == configdoc.table()


def test_the_docs_writer_replaces_a_stale_table_and_keeps_the_prose(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    stale = tmp_path / "configuration.md"
    stale.write_text(DOCS.read_text().replace("| `LOG_LEVEL` | `info` |", "| `LOG_LEVEL` | `x` |"))
    monkeypatch.setattr(configdoc, "DOC", stale)
    assert configdoc.main(["--write"]) == 0
    assert stale.read_text() == DOCS.read_text()


def test_well_formed_database_urls_are_accepted_whatever_their_reachability() -> None:
    for url in (
        "postgresql://gc:secret@db.example:5432/app?sslmode=require",
        "postgres://gc@127.0.0.1:1/x",
        "postgresql:///app?host=/var/run/postgresql",
        "postgresql://[::1]:5432/app",
    ):
        assert config.load({P + "DATABASE_URL": url}).database.url == url


def test_database_urls_that_cannot_be_parsed_are_errors_naming_the_variable() -> None:
    for url in ("notaurl", "http://gc:secret@db/app", "postgresql://gc:secret@db:x/app", "db:5432"):
        with pytest.raises(config.ConfigError) as err:
            config.load({P + "DATABASE_URL": url})
        assert err.value.variable == P + "DATABASE_URL"
        assert "secret" not in str(err.value)


def test_libpq_multi_host_urls_are_accepted() -> None:
    for url in (
        "postgresql://gc:secret@h1:5432,h2:5433/app?target_session_attrs=read-write",
        "postgresql://gc:secret@h1,h2/app?target_session_attrs=primary",
        "postgresql://gc@[::1]:5432,127.0.0.1:5433/app",
    ):
        assert config.load({P + "DATABASE_URL": url}).database.url == url


def test_a_bad_port_is_named_as_such() -> None:
    for url in ("postgresql://gc:secret@127.0.0.1:notaport/db", "postgresql://gc@h1:5432,h2:x/db"):
        with pytest.raises(config.ConfigError) as err:
            config.load({P + "DATABASE_URL": url})
        assert "is not a number" in str(err.value)
        assert "secret" not in str(err.value)


def test_a_url_asking_for_a_standby_is_refused_at_start() -> None:
    for attrs in ("standby", "read-only", "prefer-standby"):
        url = f"postgresql://gc@h1,h2/app?target_session_attrs={attrs}"
        with pytest.raises(config.ConfigError) as err:
            config.load({P + "DATABASE_URL": url})
        assert "needs the primary" in str(err.value), attrs


def test_the_listener_url_defaults_to_the_database_url_and_can_be_its_own() -> None:
    url, direct = "postgresql://gc@pooler:6432/app", "postgresql://gc@primary:5432/app"
    shared = config.load({P + "DATABASE_URL": url}).database
    assert (config.pool_url(shared), config.listener_url_now(shared)) == (url, url)
    own = config.load({P + "DATABASE_URL": url, P + "LISTENER_DATABASE_URL": direct}).database
    assert (config.pool_url(own), config.listener_url_now(own)) == (url, direct)
    with pytest.raises(config.ConfigError) as err:
        config.load({P + "LISTENER_DATABASE_URL": "mysql://x"})
    assert err.value.variable == P + "LISTENER_DATABASE_URL"


def test_url_files_are_read_again_for_every_new_connection(tmp_path: Path) -> None:
    pool_file, listener_file = tmp_path / "url", tmp_path / "listener-url"
    pool_file.write_text("postgresql://gc:old@db/app\n")
    listener_file.write_text("postgresql://gc:old@primary/app\n")
    settings = config.load(
        {
            P + "DATABASE_URL_FILE": str(pool_file),
            P + "LISTENER_DATABASE_URL_FILE": str(listener_file),
        }
    ).database
    pool_file.write_text("postgresql://gc:new@db/app\n")
    listener_file.write_text("postgresql://gc:new@primary/app\n")
    assert config.pool_url(settings) == "postgresql://gc:new@db/app"
    assert config.listener_url_now(settings) == "postgresql://gc:new@primary/app"
    pool_file.write_text("")
    with pytest.raises(config.ConfigError) as err:
        config.pool_url(settings)
    assert err.value.variable == P + "DATABASE_URL_FILE"
    # Without a file of its own, the listener follows the pool's file.
    shared = config.load({P + "DATABASE_URL_FILE": str(listener_file)}).database
    listener_file.write_text("postgresql://gc:newer@primary/app\n")
    assert config.listener_url_now(shared) == "postgresql://gc:newer@primary/app"


def test_the_watch_silence_bound_defaults_above_the_bookmark_cadence_and_is_clamped() -> None:
    # A real API server sends a watch a bookmark every 60 s: the default stays above it.
    assert config.load({}).kube.watch_silence_s == 75.0
    s = config.load({P + "WATCH_SILENCE_SECONDS": "2.5"})
    assert (s.kube.watch_silence_s, s.warnings) == (2.5, ())
    s = config.load({P + "WATCH_SILENCE_SECONDS": "0"})
    assert s.kube.watch_silence_s == 1.0
    assert any(f"{P}WATCH_SILENCE_SECONDS='0'" in w for w in s.warnings)
