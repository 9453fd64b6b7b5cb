"""The plain-data (JSON-safe) form of a :class:`~tpusync.kv.KVStoreConfig`, for configuration
files and the engine connectors' extra config (``KVStoreConfig.from_dict`` / ``.to_dict``).

Top-level keys are ``KVStoreConfig``'s field names (``model_id``, ``block_size``, ...); each
tier is a section named after its kind whose keys are its spec's field names::

    {"model_id": "m", "block_size": 16, "secret_file": "/etc/tpusync/secret",
     "dram": {"capacity_blocks": 4096, "name": "a"},
     "disk": {"directory": "/mnt/nvme/kv", "capacity_blocks": 100000},
     "shared_fs": {"directory": "/mnt/lustre/kv", "mac": true}}

* Lower tiers come in the order of their sections; a section may be a list of objects for
  several tiers of one kind (each with its own ``name``).
* A secret is never written inline: ``"secret_file"`` names the file that holds it, for the
  store's ``secret`` and for a tier spec's, read by :func:`tpusync.kv.load_secret` under the
  rules of ``tpusync serve --secret-file`` (mode 0600, this uid's, hex text or raw bytes, at
  least 16 bytes; a FIFO or a symlink is refused, never waited on).
* ``salt`` is hex. Bytes, ``ssl`` contexts and other objects have no plain form: ``to_dict``
  refuses a config that holds one (naming the key). A section whose spec takes ``tls`` (a
  client's ``ssl.SSLContext``) may name a CA bundle instead: ``"tls_ca": "/etc/tpusync/ca.pem"``
  (a default client context that trusts that CA and checks the server's address).
* Unknown keys are errors naming the key and its section.

Sections: ``"dram"``, ``"disk"``, ``"shared_fs"``, and those the tiers over other hosts add
when :mod:`tpusync.cluster` is imported (``"store_node"``, ``"peer"``); a new tier kind
registers its section with :func:`register_tier_section`.
"""

from __future__ import annotations

import dataclasses
import os
import ssl
from collections.abc import Mapping
from typing import Any

from tpusync._src.kv.keys import DEFAULT_SECRET, MAX_SECRET_BYTES
from tpusync._src.kv.secret import check_secret, load_secret
from tpusync._src.kv.tier_specs import DiskTier, DramTier, SharedFsTier
from tpusync.errors import InvalidArgumentError

__all__ = [
    "client_tls",
    "fields_from_dict",
    "fields_to_dict",
    "register_tier_section",
    "server_tls",
]

_SECTIONS: dict[str, type] = {"disk": DiskTier, "shared_fs": SharedFsTier}
_NOT_PLAIN = ("key_scheme", "tiers", "dram", "secret")


def register_tier_section(section: str, spec_class: type) -> None:
    """Makes ``section`` of the plain form a tier of ``spec_class`` (a dataclass tier spec
    whose fields are the section's keys). Registering the same class again is a no-op."""
    known = _SECTIONS.get(section)
    if known is not None and known is not spec_class:
        raise InvalidArgumentError(
            f"section: {section!r} is already the section of {known.__name__}; choose another"
        )
    _SECTIONS[section] = spec_class


_PLAIN_NAMES = {"secret": "secret_file", "tls": "tls_ca"}  # fields given by a file's name


def client_tls(ca_file: Any, where: str) -> ssl.SSLContext:
    """A TLS client context that trusts the CA bundle in ``ca_file`` (PEM) and checks the
    server's name or address against its certificate."""
    if not isinstance(ca_file, str | os.PathLike) or not os.fspath(ca_file):
        raise InvalidArgumentError(
            f"{where}: expected the path of a PEM CA bundle, got {ca_file!r}"
        )
    try:
        return ssl.create_default_context(cafile=os.fspath(ca_file))
    except (OSError, ssl.SSLError) as exc:
        raise InvalidArgumentError(
            f"{where}: cannot load {os.fspath(ca_file)} as a PEM CA bundle: {exc}"
        ) from None


def server_tls(cert_file: Any, key_file: Any, where: str) -> ssl.SSLContext:
    """A TLS server context with the certificate chain in ``cert_file`` and its private key in
    ``key_file`` (both PEM)."""
    for name, value in (("tls_cert", cert_file), ("tls_key", key_file)):
        if not isinstance(value, str | os.PathLike) or not os.fspath(value):
            raise InvalidArgumentError(
                f"{where}.{name}: expected the path of a PEM file, got {value!r} (give "
                "tls_cert and tls_key together)"
            )
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        context.load_cert_chain(os.fspath(cert_file), os.fspath(key_file))
    except (OSError, ssl.SSLError) as exc:
        raise InvalidArgumentError(
            f"{where}.tls_cert, {where}.tls_key: cannot load {os.fspath(cert_file)} with "
            f"{os.fspath(key_file)} (a PEM certificate chain and its private key): {exc}"
        ) from None
    return context


def _spec_from_section(spec_class: type, values: Any, where: str) -> Any:
    if not isinstance(values, Mapping):
        raise InvalidArgumentError(
            f"{where}: expected an object of {spec_class.__name__} fields, got "
            f"{type(values).__name__}"
        )
    fields = {f.name: f for f in dataclasses.fields(spec_class)}
    kwargs: dict[str, Any] = {}
    for key, value in values.items():
        if key == "secret_file" and "secret" in fields:
            kwargs["secret"] = load_secret(value, argument=f"{where}.secret_file")
        elif key == "tls_ca" and "tls" in fields:
            kwargs["tls"] = client_tls(value, f"{where}.tls_ca")
        elif key not in fields or key in ("secret", "tls"):
            allowed = sorted(_PLAIN_NAMES.get(n, n) for n in fields)
            raise InvalidArgumentError(
                f"{where}.{key}: unknown key; {spec_class.__name__} takes {', '.join(allowed)}"
            )
        else:
            kwargs[key] = tuple(value) if isinstance(value, list) else value
    try:
        return spec_class(**kwargs)
    except TypeError as exc:  # a required field missing
        raise InvalidArgumentError(f"{where}: {exc}") from None


def fields_from_dict(data: Mapping[str, Any], config_class: type) -> dict[str, Any]:
    """The keyword arguments of ``config_class`` (``KVStoreConfig``) that ``data`` describes."""
    if not isinstance(data, Mapping):
        raise InvalidArgumentError(
            f"config: expected a mapping (e.g. parsed JSON), got {type(data).__name__}"
        )
    plain = {f.name for f in dataclasses.fields(config_class)} - set(_NOT_PLAIN)
    kwargs: dict[str, Any] = {}
    tiers: list[Any] = []
    for key, value in data.items():
        if key == "dram":
            kwargs["dram"] = _spec_from_section(DramTier, value, "dram")
        elif key in _SECTIONS:
            entries = value if isinstance(value, list) else [value]
            for i, entry in enumerate(entries):
                where = key if not isinstance(value, list) else f"{key}[{i}]"
                tiers.append(_spec_from_section(_SECTIONS[key], entry, where))
        elif key == "secret_file":
            secret = load_secret(value, argument="secret_file")
            # the store's key scheme (BLAKE2b) takes at most 64: refused here, naming the file
            kwargs["secret"] = check_secret(
                secret, f"secret_file ({os.fspath(value)})", at_most=MAX_SECRET_BYTES
            )
        elif key == "salt":
            if not isinstance(value, str):
                raise InvalidArgumentError(f"salt: expected a hex string, got {value!r}")
            try:
                kwargs["salt"] = bytes.fromhex(value)
            except ValueError:
                raise InvalidArgumentError(f"salt: expected a hex string, got {value!r}") from None
        elif key in plain:
            kwargs[key] = value
        else:
            hint = (
                " (a store node or registry section: import tpusync.cluster first)"
                if key in ("store_node", "peer", "registry")
                else ""
            )
            raise InvalidArgumentError(
                f"{key}: unknown key of the store's config{hint}; known: "
                f"{', '.join(sorted({*plain, 'salt', 'secret_file', 'dram', *_SECTIONS}))}"
            )
    if "dram" not in kwargs:
        raise InvalidArgumentError('dram: missing; give "dram": {"capacity_blocks": N}')
    kwargs["tiers"] = tuple(tiers)
    return kwargs


def _plain_value(value: Any, where: str) -> Any:
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    if isinstance(value, tuple | list):
        return [_plain_value(v, where) for v in value]
    raise InvalidArgumentError(
        f"{where}: a {type(value).__name__} has no plain-data form; build this config in code"
    )


def _section_of(spec: Any) -> str:
    for section, spec_class in _SECTIONS.items():
        if type(spec) is spec_class:
            return section
    raise InvalidArgumentError(
        f"tiers: a {type(spec).__name__} has no plain-data section (register one with "
        "tpusync._src.kv.config_dict.register_tier_section)"
    )


def _spec_to_section(spec: Any, where: str, secret_files: Mapping[str, str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for f in dataclasses.fields(spec):
        value = getattr(spec, f.name)
        if value == f.default:
            continue
        if f.name == "secret":
            if spec.name not in secret_files:
                raise InvalidArgumentError(
                    f"{where}.secret: a secret is not written into a dict; pass "
                    f"secret_files={{{spec.name!r}: path}} (the file that holds it)"
                )
            out["secret_file"] = secret_files[spec.name]
            continue
        if f.name == "tls":  # a context keeps no trace of the CA bundle it was made from
            raise InvalidArgumentError(
                f"{where}.tls: an ssl.SSLContext has no plain-data form (it keeps no trace of "
                "the CA bundle it was made from); call to_dict on a copy whose spec has "
                f'tls=None (dataclasses.replace), then set "tls_ca" in its {where} section to '
                "the PEM CA bundle's path"
            )
        out[f.name] = _plain_value(value, f"{where}.{f.name}")
    return out


def fields_to_dict(
    config: Any, *, secret_file: str | None = None, secret_files: Mapping[str, str] | None = None
) -> dict[str, Any]:
    """The plain form of ``config`` (a ``KVStoreConfig``); fields at their default are left
    out. A secret other than the default is written as ``secret_file`` (given: the file that
    holds it, checked to hold it); ``secret_files`` does the same for tier specs, by name."""
    secret_files = secret_files or {}
    if config.key_scheme is not None:
        raise InvalidArgumentError(
            "key_scheme: a key scheme has no plain-data form; build this config in code"
        )
    out: dict[str, Any] = {}
    for f in dataclasses.fields(config):
        if f.name in _NOT_PLAIN:
            continue
        value = getattr(config, f.name)
        if value == f.default:
            continue
        out[f.name] = value.hex() if f.name == "salt" else _plain_value(value, f.name)
    if config.secret != DEFAULT_SECRET:
        if secret_file is None:
            raise InvalidArgumentError(
                "secret: a secret is not written into a dict; pass secret_file= the file that "
                "holds it"
            )
        if load_secret(secret_file, argument="secret_file") != config.secret:
            raise InvalidArgumentError(
                f"secret_file: {secret_file} holds another secret than this config's"
            )
        out["secret_file"] = os.fspath(secret_file)
    out["dram"] = _spec_to_section(config.dram, "dram", secret_files)
    sections: dict[str, list[dict[str, Any]]] = {}
    for spec in config.tiers:
        section = _section_of(spec)
        entries = sections.setdefault(section, [])
        entries.append(_spec_to_section(spec, f"{section}", secret_files))
    if len(sections) > 1 and _out_of_order(config.tiers):
        raise InvalidArgumentError(
            "tiers: tiers of one kind apart from each other (e.g. disk, shared_fs, disk) have "
            "no plain-data form (sections keep their kind together); reorder them"
        )
    for section, entries in sections.items():
        out[section] = entries[0] if len(entries) == 1 else entries
    return out


def _out_of_order(tiers: tuple[Any, ...]) -> bool:
    """Whether tiers of one kind are not next to each other."""
    kinds = [type(t) for t in tiers]
    runs = [k for i, k in enumerate(kinds) if i == 0 or kinds[i - 1] is not k]
    return len(runs) != len(set(runs))
