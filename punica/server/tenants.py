"""Tenants: who sends a request, resolved at the edge from its API key, and what they may do.

`punica serve --tenants FILE` reads a TOML file:

    [admin]
    api_keys = ["sha256:<hex>"]     # may do anything
    [tenants.acme]
    api_keys = ["sha256:<hex>"]
    adapters = ["acme-*"]           # globs (fnmatch) of the adapters it may use, load and unload
    weight = 1.0                    # its fair share of the engine (punica.engine.tenancy.TenantShare)
    max_concurrent_requests = 64    # optional caps
    max_kv_tokens = 100000

Keys are kept as SHA-256 hashes (`punica hash-key` makes one) and a presented key is compared in
constant time with every stored hash. Every tenant may use the base model. The tenant's name is
the id its requests carry to the engine; the admin's requests carry ADMIN. Without a file, the
server's --api-key and --admin-api-key decide (`keys_caller`).
"""

from __future__ import annotations

import hashlib
import hmac
import math
import re
import sys
from dataclasses import dataclass
from fnmatch import fnmatchcase
from pathlib import Path
from typing import Any

from punica.engine.tenancy import TenantShare

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

KEY_HASH = re.compile(r"sha256:[0-9a-f]{64}")
TENANT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
ADMIN = "admin"  # the tenant id of the admin's requests, so no tenant may have this name
TENANT_FIELDS = ("api_keys", "adapters", "weight", "max_concurrent_requests", "max_kv_tokens")


class TenantsFileError(ValueError):
    """A tenants file that cannot be used; the message names the file, the table and the key."""


def hash_key(key: str) -> str:
    """The form a tenants file stores an API key in: "sha256:" and the hex SHA-256 of its UTF-8 bytes."""
    return "sha256:" + hashlib.sha256(key.encode()).hexdigest()


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


@dataclass(frozen=True)
class Caller:
    """Who sent a request, and so what it may do."""
    tenant: str | None                   # the id its requests carry to the engine (None without a tenants file)
    admin: bool = False                  # any adapter, any load or unload, /metrics, /v1/adapters, adapter paths
    adapters: tuple[str, ...] = ("*",)   # globs of the adapters it may use
    manages_adapters: bool = False       # it may load and unload the names its globs match

    def may_use(self, adapter: str) -> bool:
        return self.admin or any(fnmatchcase(adapter, glob) for glob in self.adapters)

    def may_manage(self, adapter: str) -> bool:
        return self.admin or (self.manages_adapters and self.may_use(adapter))


@dataclass(frozen=True)
class Tenants:
    """A tenants file, read and checked."""
    keys: tuple[tuple[bytes, Caller], ...]        # (the SHA-256 digest of a key, who holds it)
    shares: dict[str, TenantShare]                # by tenant name

    def identify(self, key: str) -> Caller | None:
        """The holder of `key`, None for a key of no one. Every stored hash is compared, each in
        constant time, so the time taken says nothing about which hash, if any, is near."""
        digest, holder = _digest(key), None
        for stored, caller in self.keys:
            if hmac.compare_digest(digest, stored):
                holder = caller
        return holder


def keys_caller(key: str | None, api_key: str | None, admin_api_key: str | None) -> Caller | None:
    """The caller presenting `key` (None: no key) to a server without a tenants file; None when the
    key is missing or wrong. The holder of --admin-api-key is the admin; a request with --api-key (or
    any request, without one) may use every adapter, and is the admin too unless --admin-api-key is set."""
    if admin_api_key is not None and key is not None and hmac.compare_digest(_digest(key), _digest(admin_api_key)):
        return Caller(None, admin=True)
    if api_key is None or (key is not None and hmac.compare_digest(_digest(key), _digest(api_key))):
        return Caller(None, admin=admin_api_key is None)
    return None


def read_tenants(path: str | Path) -> Tenants:
    """The tenants file at `path`, fully checked: a TenantsFileError names what is wrong."""
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except OSError as e:
        raise TenantsFileError(f"cannot read the tenants file {path}: {e.strerror}") from e
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise TenantsFileError(f"{path}: not valid TOML: {e}") from e
    return _FileReader(str(path)).tenants(data)


class _FileReader:
    """Checks one file's parsed TOML; every error is prefixed with the file's path."""

    def __init__(self, path: str):
        self.path = path
        self.holders: dict[str, str] = {}  # key hash -> the table that holds it

    def error(self, message: str) -> TenantsFileError:
        return TenantsFileError(f"{self.path}: {message}")

    def tenants(self, data: dict[str, Any]) -> Tenants:
        unknown = sorted(set(data) - {"admin", "tenants"})
        if unknown:
            raise self.error(f"unknown top-level key {unknown[0]!r} (a tenants file has an [admin] table and "
                             "[tenants.NAME] tables)")
        keys: list[tuple[bytes, Caller]] = []
        if "admin" in data:
            admin = self.table(data["admin"], "[admin]")
            self.known_fields(admin, "[admin]", ("api_keys",))
            if "api_keys" not in admin:
                raise self.error("[admin] has no api_keys")
            keys += [(digest, Caller(ADMIN, admin=True)) for digest in self.key_hashes(admin["api_keys"], "[admin]")]
        tenants = self.table(data.get("tenants", {}), "[tenants]")
        if not keys and not tenants:
            raise self.error("there is no [admin] table and no [tenants.NAME] table: nobody could use the server")
        shares = {}
        for name, table in tenants.items():
            where = f"[tenants.{name}]"
            if not TENANT_NAME.fullmatch(name):
                raise self.error(f"[tenants] {name!r} is not a tenant name: 1 to 64 ASCII letters, digits, '.', '_' "
                                 "and '-', the first a letter or digit")
            if name == ADMIN:
                raise self.error(f"{where}: {ADMIN!r} is the id of the [admin] table's requests; name the tenant "
                                 "otherwise")
            caller, shares[name] = self.tenant(name, self.table(table, where), where)
            keys += [(digest, caller) for digest in self.key_hashes(table["api_keys"], where)]
        return Tenants(tuple(keys), shares)

    def table(self, value: Any, where: str) -> dict[str, Any]:
        if not isinstance(value, dict):
            raise self.error(f"{where} must be a table, got {type(value).__name__}")
        return value

    def known_fields(self, table: dict[str, Any], where: str, fields: tuple[str, ...]) -> None:
        unknown = sorted(set(table) - set(fields))
        if unknown:
            raise self.error(f"{where}: unknown key {unknown[0]!r} (known: {', '.join(fields)})")

    def key_hashes(self, value: Any, where: str) -> list[bytes]:
        if not isinstance(value, list):
            raise self.error(f"{where} api_keys must be a list of key hashes, got {type(value).__name__}")
        digests = []
        for i, item in enumerate(value):
            # the value is not repeated: it may be a key pasted where its hash belongs
            if not isinstance(item, str) or not KEY_HASH.fullmatch(item.lower()):
                raise self.error(f"{where} api_keys[{i}] is not 'sha256:' and 64 hex digits; store keys hashed "
                                 "(`punica hash-key` reads a key on stdin and prints its hash)")
            item = item.lower()
            if item in self.holders:
                other = self.holders[item]
                raise self.error(f"{where} api_keys[{i}] is also a key of {other}: a key belongs to one holder"
                                 if other != where else f"{where} api_keys[{i}] is listed twice")
            self.holders[item] = where
            digests.append(bytes.fromhex(item.removeprefix("sha256:")))
        return digests

    def tenant(self, name: str, table: dict[str, Any], where: str) -> tuple[Caller, TenantShare]:
        self.known_fields(table, where, TENANT_FIELDS)
        if "api_keys" not in table:
            raise self.error(f"{where} has no api_keys")
        globs = table.get("adapters", [])
        if not isinstance(globs, list) or not all(isinstance(g, str) and g for g in globs):
            raise self.error(f"{where} adapters must be a list of adapter names or globs (e.g. [\"{name}-*\"])")
        weight = table.get("weight", 1.0)
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not (0 < weight < math.inf):
            raise self.error(f"{where} weight must be a number > 0, got {weight!r}")
        caps = {}
        for cap in ("max_concurrent_requests", "max_kv_tokens"):
            value = table.get(cap)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise self.error(f"{where} {cap} must be an integer >= 1, got {value!r}")
            caps[cap] = value
        caller = Caller(name, adapters=tuple(globs), manages_adapters=True)
        return caller, TenantShare(weight=float(weight), **caps)
