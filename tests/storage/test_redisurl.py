"""The Sentinel and Redis Cluster URL forms: every part read as documented, a wrong URL refused
with the reason."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from proxy.storage.redis.url import (
    ClusterURL,
    SentinelURL,
    check_storage_url,
    parse_cluster_url,
    parse_sentinel_url,
)
from tests.reliability.state import policy_text
from tests.servers import free_port
from tests.test_cli import tokenweir


def test_a_sentinel_url_names_its_sentinels_service_database_and_login() -> None:
    url = "redis+sentinel://app:p%40ss@10.0.0.1:26380,[::1]:26381,sentinel-c/tokenweir/3"
    assert parse_sentinel_url(url) == SentinelURL(
        sentinels=(("10.0.0.1", 26380), ("::1", 26381), ("sentinel-c", 26379)),
        service="tokenweir",
        db=3,
        username="app",
        password="p@ss",
    )


def test_the_database_and_login_are_optional() -> None:
    assert parse_sentinel_url("redis+sentinel://127.0.0.1:26379/mymaster") == SentinelURL(
        sentinels=(("127.0.0.1", 26379),), service="mymaster"
    )
    with_password = parse_sentinel_url("redis+sentinel://:secret@h/mymaster/")
    assert (with_password.username, with_password.password) == (None, "secret")


@pytest.mark.parametrize(
    ("url", "reason"),
    [
        ("redis+sentinel://h:26379", "names its service"),
        ("redis+sentinel://h:26379/", "names its service"),
        ("redis+sentinel:///mymaster", "at least one host"),
        ("redis+sentinel://h1,,h2/mymaster", "at least one host"),
        ("redis+sentinel://:26379/mymaster", "host is missing"),
        ("redis+sentinel://h:port/mymaster", "port is a number"),
        ("redis+sentinel://h:70000/mymaster", "port is a number"),
        ("redis+sentinel://h/mymaster/zero", "database after the service is a number"),
        ("redis+sentinel://h/mymaster?ssl=true", "no query"),
    ],
)
def test_a_wrong_sentinel_url_says_what_is_wrong(url: str, reason: str) -> None:
    with pytest.raises(ValueError, match=reason):
        check_storage_url(url)


def test_other_storage_urls_pass_unparsed() -> None:
    for url in ("memory", "redis://127.0.0.1:6379/0", "rediss://h:6380/0", "unix:///run/r.sock"):
        assert check_storage_url(url) == url
    with pytest.raises(ValueError, match="storage is memory"):
        check_storage_url("redis-sentinel://h/mymaster")


def test_a_cluster_url_names_its_nodes_login_and_tls() -> None:
    url = "rediss+cluster://app:p%40ss@10.0.0.1:7000,[::1]:7001,redis-c/0"
    assert parse_cluster_url(url) == ClusterURL(
        nodes=(("10.0.0.1", 7000), ("::1", 7001), ("redis-c", 6379)),
        tls=True,
        username="app",
        password="p@ss",
    )
    assert parse_cluster_url("redis+cluster://127.0.0.1:7000") == ClusterURL(
        nodes=(("127.0.0.1", 7000),)
    )
    assert parse_cluster_url("redis+cluster://:secret@h/").password == "secret"


@pytest.mark.parametrize(
    ("url", "reason"),
    [
        ("redis+cluster://", "at least one host"),
        ("redis+cluster://h1,,h2", "at least one host"),
        ("redis+cluster://:7000", "host is missing"),
        ("redis+cluster://h:0", "port is a number"),
        ("redis+cluster://h:7000/1", "only database 0"),
        ("redis+cluster://h:7000?ssl_cert_reqs=none", "no query"),
    ],
)
def test_a_wrong_cluster_url_says_what_is_wrong(url: str, reason: str) -> None:
    with pytest.raises(ValueError, match=reason):
        check_storage_url(url)


@pytest.mark.parametrize(
    ("url", "reason"),
    [
        ("redis://:s3cret@h:6379/0?sockettimeout=1", "no option 'sockettimeout'"),
        ("redis://:s3cret@h:6379/0?ssl_ca_certs=/ca.pem", "only with TLS, rediss://"),
        ("unix://:s3cret@/run/redis.sock?socket_keepalive=true", "no option 'socket_keepalive'"),
        ("redis://:s3cret@h:6379/0?socket_timeout=1s", "Invalid value for 'socket_timeout'"),
        ("redis://:s3cret@h:63790000/0", "Port out of range"),
        ("redis://:s3cret@h:port/0", "Port could not be cast"),
        ("redis://:s3cret@[::1:6379/0", "Invalid IPv6 URL"),
        ("redis://:s3cret@h:6379/zero", "database after the host is a number"),
    ],
)
def test_a_wrong_one_server_url_says_what_is_wrong_without_its_password(
    url: str, reason: str
) -> None:
    """redis-py took each and failed later: at the first call (an option its connection does not
    take), or at startup on a traceback, or (a database not a number) used database 0."""
    with pytest.raises(ValueError, match=re.escape(reason)) as refused:
        check_storage_url(url)
    assert "s3cret" not in str(refused.value)


def test_one_server_urls_with_their_options_pass() -> None:
    for url in (
        "redis://u:p%40ss%3A%2F@[::1]:6379/2?socket_timeout=0.5&client_name=gw&max_connections=9",
        "rediss://h:6380/0?ssl_ca_certs=/ca.pem&ssl_cert_reqs=none&ssl_check_hostname=false",
        "unix:///run/redis.sock?db=1",
        "unix:///run/redis/redis-server@6379.sock",
        "redis://h:6379/0?client_name=gw@east",
        "redis://h",
    ):
        assert check_storage_url(url) == url


def test_serve_refuses_a_storage_url_with_an_unknown_option_readably(tmp_path: Path) -> None:
    """`policy check` passed it, and `serve` died at startup on redis-py's TypeError traceback
    ("unexpected keyword argument 'sockettimeout'")."""
    config = tmp_path / "policy.yaml"
    storage = "redis://:s3cret@127.0.0.1:9/0?sockettimeout=1"
    config.write_text(policy_text("http://127.0.0.1:9", storage))
    checked = tokenweir("policy", "check", str(config))
    assert checked.returncode == 1, checked.stdout
    assert f"{config}:2: storage: a Redis URL takes no option 'sockettimeout'" in checked.stderr
    served = tokenweir("serve", "--config", str(config), "--port", str(free_port()))
    assert served.returncode == 1, served.stderr[-2000:]
    assert served.stderr.startswith("tokenweir: the policy cannot be used:"), served.stderr[-2000:]
    assert f"{config}:2: storage: a Redis URL takes no option 'sockettimeout'" in served.stderr
    assert "Traceback" not in served.stderr
    assert "s3cret" not in checked.stderr + served.stderr


@pytest.mark.parametrize(
    "url",
    [
        "redis://:Ab3/xY+z@h:6379/0",
        "redis://:Ab3?xY@h:6379/0",
        "rediss://app:Ab3#xY@h:6380/0",
        "unix://:Ab3/xY@/run/redis.sock",
        "redis+sentinel://:Ab3/xY+z@h:26379/tokenweir",
        "redis+cluster://app:Ab3/xY@h1:7000,h2:7001",
    ],
)
def test_a_password_not_percent_encoded_is_refused_without_repeating_it(url: str) -> None:
    """A bare '/' ended the hosts inside the password, and the error quoted what it took for
    the host or port: 'a Redis Cluster port is a number from 1 to 65535, got 'Ab3''."""
    with pytest.raises(ValueError, match="percent-encode") as refused:
        check_storage_url(url)
    assert "Ab3" not in str(refused.value)
