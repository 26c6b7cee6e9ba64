"""The policy examples in docs/ stay true: every YAML block there loads (a fragment, set into a
small whole policy), every policy key path the pages name (`upstream.pool_timeout`,
`models.*.price`) is one the loader takes, and every default docs/operations.md's settings
table gives is the code's."""

from __future__ import annotations

import re
import typing
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import BaseModel

from proxy.policy import parse_policy
from proxy.policy.model import (
    Budget,
    CacheSpec,
    CircuitSpec,
    DegradeThen,
    DegradeWhen,
    EmbedderSpec,
    HnswSpec,
    Limits,
    Policy,
    Price,
    ServerSpec,
    UpstreamSpec,
    VerifierSpec,
)
from proxy.policy.units import hash_key, parse_bytes, parse_duration_s

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
_BLOCK = re.compile(r"^```yaml\n(.*?)^```", re.S | re.M)
_KEY = hash_key("docs-example-key")
# The models the examples name: a fragment naming one is read beside a backend serving them all.
_MODELS = ("qwen2.5-7b-instruct", "qwen2.5-72b-instruct", "qwen2.5-1.5b-instruct",
           "text-embedding-3-small")  # fmt: skip
_BASE: dict[str, Any] = {
    "backends": [{"name": "docs-base", "url": "http://127.0.0.1:9/v1", "models": list(_MODELS)}],
    "models": {name: {} for name in _MODELS},
    "tenants": {
        "support-bot": {
            "api_keys": [_KEY],
            "models": ["qwen2.5-7b-instruct", "qwen2.5-72b-instruct"],
            "budget": {"tokens_per_day": 1_000_000},  # `budget_used_above` needs a quota
        }
    },
}


def _blocks() -> list[tuple[str, str]]:
    found = []
    for page in sorted(DOCS.glob("*.md")):
        text = page.read_text(encoding="utf-8")
        for match in _BLOCK.finditer(text):
            line = text.count("\n", 0, match.start()) + 1
            found.append((f"docs/{page.name}:{line}", match.group(1)))
    return found


def _merged(base: Any, block: Any, key: str = "") -> Any:
    """`block` set into `base`: mappings merged, backends added to the base's, the rest replaced."""
    if isinstance(base, dict) and isinstance(block, dict):
        out = dict(base)
        for name, value in block.items():
            out[name] = _merged(base[name], value, name) if name in base else value
        return out
    if key == "backends":
        return [*base, *block]
    return block


@pytest.mark.parametrize(("where", "block"), _blocks(), ids=[where for where, _ in _blocks()])
def test_every_yaml_example_in_the_docs_loads(where: str, block: str) -> None:
    fragment = yaml.safe_load(block.replace("sha256:...", _KEY))
    text = yaml.safe_dump(_merged(_BASE, fragment), allow_unicode=True, sort_keys=False)
    # Raises PolicyError naming every problem: the example says what the loader refuses.
    parse_policy(text, file=where, environ={"VLLM_API_KEY": "docs-example-backend-key"})


def test_the_docs_have_yaml_examples() -> None:
    assert len(_blocks()) >= 5  # the parsing above still finds them


_ROW = re.compile(r"^\| `(server|upstream)\.(\w+)` \| ([^|]+?) \|", re.M)


def _value(default: str, code: object) -> object:
    if default == "none":
        return None
    if isinstance(code, float):
        return parse_duration_s(default)
    return parse_bytes(default)


def test_the_settings_table_gives_the_code_defaults() -> None:
    text = (DOCS / "operations.md").read_text(encoding="utf-8")
    sections: dict[str, BaseModel] = {"server": ServerSpec(), "upstream": UpstreamSpec()}
    rows = _ROW.findall(text)
    assert len(rows) >= 10
    for section, key, default in rows:
        code = getattr(sections[section], key)
        assert _value(default, code) == code, f"{section}.{key}: docs say {default}, code {code}"


# What a key path's first part names, where it is not the file's top level.
_SECTIONS: dict[str, type[BaseModel]] = {
    "server": ServerSpec, "upstream": UpstreamSpec, "circuit": CircuitSpec, "cache": CacheSpec,
    "hnsw": HnswSpec, "verifier": VerifierSpec, "embedder": EmbedderSpec, "limits": Limits,
    "budget": Budget, "price": Price, "when": DegradeWhen, "then": DegradeThen,
}  # fmt: skip
# Paths that are no policy keys: span attributes, a pattern of several keys, a function, a
# field of /readyz's answer.
_NOT_KEYS = {
    "server.address", "server.port", "upstream.*", "ledger.base.bounded", "ledger.evicting",
}  # fmt: skip


def _model_in(annotation: object) -> type[BaseModel] | None:
    """The pydantic model a field holds (itself, or in a tuple, dict or optional)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for argument in typing.get_args(annotation):
        if (found := _model_in(argument)) is not None:
            return found
    return None


def _takes(model: type[BaseModel] | None, keys: list[str]) -> bool:
    for key in keys:
        field = None if model is None else model.model_fields.get(key)
        if field is None:
            return False
        model = _model_in(field.annotation)
    return True


def _named_paths() -> list[tuple[str, str]]:
    found = []
    for page in [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]:
        text = re.sub(r"^```.*?^```", "", page.read_text(encoding="utf-8"), flags=re.S | re.M)
        for match in re.finditer(r"`([a-z_]+(?:\[\]|\.\*|\.[a-z_0-9]+)+)`", text):
            line = text.count("\n", 0, match.start()) + 1
            found.append((f"{page.relative_to(ROOT)}:{line}", match.group(1)))
    return found


def test_every_policy_key_path_the_docs_name_is_taken() -> None:
    checked, unknown = 0, []
    for where, path in _named_paths():
        parts = [part for part in re.split(r"\.|\[\]", path) if part]
        if path in _NOT_KEYS or not (parts[0] in _SECTIONS or parts[0] in Policy.model_fields):
            continue
        if parts[0] in _SECTIONS:
            keys, model = parts[1:], _SECTIONS[parts[0]]
        else:  # from the top: `models.NAME.price`, `tenants.*.cache`: a name is no key
            named = parts[0] in ("models", "tenants")
            keys, model = [parts[0], *parts[2 if named else 1 :]], Policy
        checked += 1
        if not _takes(model, keys):
            unknown.append((where, path))
    assert checked > 40
    assert unknown == []
