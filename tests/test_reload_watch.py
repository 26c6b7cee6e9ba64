"""`tokenweir serve` on a policy file replaced rather than written: a Kubernetes ConfigMap's
symlinks moved to a new version, a copy that keeps the old file's mtime."""

from __future__ import annotations

import os
import shutil
import signal
from pathlib import Path

from proxy.policy.units import hash_key
from tests.test_cli_reload import _chat, _digest, _eventually, _ready, tokenweir_serve
from tests.test_reload import NEW_KEY, OLD_KEY, STAY_KEY, policy_text


def _configmap_version(volume: Path, version: int, text: str) -> Path:
    """A ConfigMap volume's next version as the kubelet writes it: a new timestamped directory,
    the `..data` link moved to it in one rename (`policy.yaml` links to `..data/policy.yaml`),
    then the previous version's directory deleted."""
    directory = volume / f"..2026_12_07_08_00_0{version}.{version}"
    directory.mkdir()
    (directory / "policy.yaml").write_text(text)
    (volume / "..data_tmp").symlink_to(directory.name)
    (volume / "..data_tmp").rename(volume / "..data")
    for old in volume.glob("..2026_*"):
        if old != directory:
            shutil.rmtree(old)
    return directory / "policy.yaml"


def test_sighup_and_watch_follow_a_configmap_to_its_new_version(
    backend_url: str, tmp_path: Path
) -> None:
    """`serve` resolved the symlinks of --config at start, so every reload read the first
    version's own file: once the kubelet deleted it, SIGHUP and the admin route were refused
    ("No such file or directory") and --watch never saw a change. Here a leaked key revoked
    and a new one granted by the next version, with SIGHUP, and a new tenant with --watch."""
    volume = tmp_path / "config"
    volume.mkdir()
    _configmap_version(volume, 1, policy_text(backend_url))
    config = volume / "policy.yaml"
    config.symlink_to("..data/policy.yaml")
    with tokenweir_serve(config, "--watch") as (process, url):
        assert _chat(url, OLD_KEY) == 200
        _configmap_version(volume, 2, policy_text(backend_url, leaked_key=False))
        process.send_signal(signal.SIGHUP)
        _eventually(lambda: _chat(url, OLD_KEY) == 401)
        assert _chat(url, STAY_KEY) == 200
        _configmap_version(volume, 3, policy_text(backend_url, newcomer=True))
        _eventually(lambda: _chat(url, NEW_KEY) == 200)
        assert _ready(url)["policy_hash"] == _digest(config)
    assert b"No such file" not in config.with_suffix(".log").read_bytes()


def test_watch_sees_a_file_replaced_by_one_of_the_same_size_and_mtime(
    backend_url: str, tmp_path: Path
) -> None:
    """A new version of the same size carrying the old one's mtime (a copy made with `cp -p`,
    `rsync -a` or `tar x`, then renamed over the file) was never applied: the watcher compared
    only mtime and size. It now sees the new inode and ctime (which no copy can keep)."""
    config = tmp_path / "policy.yaml"
    old = policy_text(backend_url)
    config.write_text(old)
    with tokenweir_serve(config, "--watch") as (_, url):
        assert _chat(url, OLD_KEY) == 200
        copy = tmp_path / "policy.yaml.new"
        copy.write_text(old.replace(hash_key(OLD_KEY), hash_key(NEW_KEY)))
        before = config.stat()
        os.utime(copy, ns=(before.st_atime_ns, before.st_mtime_ns))
        assert copy.stat().st_size == before.st_size
        copy.rename(config)
        _eventually(lambda: _chat(url, NEW_KEY) == 200)
        assert _chat(url, OLD_KEY) == 401
        assert _ready(url)["policy_hash"] == _digest(config)
