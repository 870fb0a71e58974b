"""The tenants file (punica serve --tenants): read, checked key by key with errors naming the table
and the key, keys kept hashed; `punica hash-key`; `punica serve` refuses a bad file with rc 2."""

import subprocess
import sys
from pathlib import Path

import pytest

from punica.engine.tenancy import TenantShare
from punica.server.tenants import ADMIN, TenantsFileError, hash_key, keys_caller, read_tenants

REPO = Path(__file__).resolve().parents[2]
ADMIN_HASH, ACME_HASH, GLOBEX_HASH = hash_key("admin-key"), hash_key("acme-key"), hash_key("globex-key")
GOOD = f"""
[admin]
api_keys = ["{ADMIN_HASH}"]

[tenants.acme]
api_keys = ["{ACME_HASH}", "{hash_key("acme-key-2").upper().replace("SHA256:", "sha256:")}"]
adapters = ["acme-*", "shared"]
weight = 2
max_concurrent_requests = 64
max_kv_tokens = 100000

[tenants.globex]
api_keys = ["{GLOBEX_HASH}"]
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "tenants.toml"
    path.write_text(text)
    return path


def test_a_good_file_gives_each_key_its_holder_and_each_tenant_its_share(tmp_path):
    tenants = read_tenants(write(tmp_path, GOOD))
    assert tenants.shares == {"acme": TenantShare(2.0, 64, 100000), "globex": TenantShare()}
    admin, acme, acme_2, globex = (tenants.identify(k) for k in ("admin-key", "acme-key", "acme-key-2", "globex-key"))
    assert admin.admin and admin.tenant == ADMIN
    assert acme == acme_2 and acme.tenant == "acme" and not acme.admin
    assert [acme.may_use(n) for n in ("acme-x", "shared", "shared-2", "globex-x")] == [True, True, False, False]
    assert acme.may_manage("acme-new") and not acme.may_manage("globex-x")
    assert globex.tenant == "globex" and not globex.may_use("acme-x")  # no adapters: the base model only
    assert tenants.identify("admin-key ") is None and tenants.identify("") is None


def test_without_a_file_the_admin_key_tells_the_admin_apart():
    assert keys_caller(None, None, None).admin  # an open server: everyone may do anything, as before
    assert keys_caller("k", "k", None).admin and keys_caller("x", "k", None) is None
    assert keys_caller(None, "k", None) is None
    user, admin = keys_caller("k", "k", "a"), keys_caller("a", "k", "a")
    assert not user.admin and user.may_use("any") and not user.may_manage("any")
    assert admin.admin and admin.tenant is None
    assert not keys_caller(None, None, "a").admin  # inference stays open, the admin endpoints need the key


BAD = [
    ('[other]\nx = 1', "unknown top-level key 'other'"),
    ("", "no [admin] table and no [tenants.NAME] table"),
    ("[admin]\n", "[admin] has no api_keys"),
    ('[admin]\napi_keys = ["{acme}"]\nkeys = []', "[admin]: unknown key 'keys'"),
    ('[tenants.acme]\napi_keys = ["{acme}"]\nadapter = ["x"]', "[tenants.acme]: unknown key 'adapter'"),
    ("[tenants.acme]\nadapters = []", "[tenants.acme] has no api_keys"),
    ('[tenants.acme]\napi_keys = ["acme-key"]', "[tenants.acme] api_keys[0] is not 'sha256:' and 64 hex digits"),
    ('[tenants.acme]\napi_keys = "{acme}"', "[tenants.acme] api_keys must be a list"),
    ('[tenants.acme]\napi_keys = ["{acme}"]\n[tenants.globex]\napi_keys = ["{globex}", "{acme}"]',
     "[tenants.globex] api_keys[1] is also a key of [tenants.acme]"),
    ('[admin]\napi_keys = ["{acme}"]\n[tenants.acme]\napi_keys = ["{acme}"]',
     "[tenants.acme] api_keys[0] is also a key of [admin]"),
    ('[tenants.acme]\napi_keys = ["{acme}", "{acme}"]', "[tenants.acme] api_keys[1] is listed twice"),
    ('[tenants.acme]\napi_keys = ["{acme}"]\nweight = 0', "[tenants.acme] weight must be a number > 0, got 0"),
    ('[tenants.acme]\napi_keys = ["{acme}"]\nweight = -1.5', "weight must be a number > 0, got -1.5"),
    ('[tenants.acme]\napi_keys = ["{acme}"]\nweight = "1"', "weight must be a number > 0, got '1'"),
    ('[tenants.acme]\napi_keys = ["{acme}"]\nweight = inf', "weight must be a number > 0, got inf"),
    ('[tenants.acme]\napi_keys = ["{acme}"]\nmax_concurrent_requests = 0',
     "[tenants.acme] max_concurrent_requests must be an integer >= 1, got 0"),
    ('[tenants.acme]\napi_keys = ["{acme}"]\nmax_kv_tokens = 1.5', "max_kv_tokens must be an integer >= 1, got 1.5"),
    ('[tenants.acme]\napi_keys = ["{acme}"]\nmax_kv_tokens = true', "max_kv_tokens must be an integer >= 1, got True"),
    ('[tenants.acme]\napi_keys = ["{acme}"]\nadapters = "acme-*"', "[tenants.acme] adapters must be a list"),
    ('[tenants.acme]\napi_keys = ["{acme}"]\nadapters = [""]', "[tenants.acme] adapters must be a list"),
    ('[tenants.admin]\napi_keys = ["{acme}"]', "[tenants.admin]: 'admin' is the id of the [admin] table's requests"),
    ('[tenants."a b"]\napi_keys = ["{acme}"]', "[tenants] 'a b' is not a tenant name"),
    ("tenants = 3", "[tenants] must be a table"),
    ("[tenants]\nacme = 3", "[tenants.acme] must be a table"),
    ("[admin\n", "not valid TOML"),
]


@pytest.mark.parametrize("text, message", BAD)
def test_a_bad_file_is_refused_naming_the_table_and_key(tmp_path, text, message):
    path = write(tmp_path, text.format(acme=ACME_HASH, globex=GLOBEX_HASH))
    with pytest.raises(TenantsFileError) as e:
        read_tenants(path)
    assert str(e.value).startswith(f"{path}: ") and message in str(e.value), str(e.value)


def test_a_key_where_its_hash_belongs_is_not_repeated_in_the_error(tmp_path):
    with pytest.raises(TenantsFileError) as e:
        read_tenants(write(tmp_path, '[tenants.acme]\napi_keys = ["my-secret-key"]'))
    assert "my-secret-key" not in str(e.value) and "punica hash-key" in str(e.value)


def test_a_missing_file_is_a_tenants_file_error(tmp_path):
    with pytest.raises(TenantsFileError, match="cannot read the tenants file"):
        read_tenants(tmp_path / "missing.toml")


def test_hash_key_command_prints_what_the_file_stores():
    result = subprocess.run([sys.executable, "-m", "punica.cli", "hash-key"], input="acme-key\n", cwd=REPO,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout == ACME_HASH + "\n"


@pytest.mark.slow
@pytest.mark.parametrize("extra, message", [
    ([], "weight must be a number > 0"),
    (["--api-key", "k"], "--tenants holds the API keys"),
])
def test_serve_exits_2_naming_what_is_wrong(tmp_path, extra, message):
    path = write(tmp_path, f'[tenants.acme]\napi_keys = ["{ACME_HASH}"]\nweight = {0 if not extra else 1}')
    result = subprocess.run([sys.executable, "-m", "punica.cli", "serve", "--tenants", str(path), *extra], cwd=REPO,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 2, result.stderr[-3000:]
    assert message in result.stderr
