"""Access options on the command line: --api-key (or MINISGL_API_KEY) and --cors-origins."""

from __future__ import annotations

import pytest

from minisgl.env import Env
from minisgl.server import args


def test_api_key_and_cors_flags():
    config = args.parse_args(["--api-key", "k1", "--cors-origins", "http://a.test", "http://b.test"])
    assert config.api_key == "k1" and config.cors_origins == ("http://a.test", "http://b.test")
    assert args.parse_args([]).cors_origins == ()


def test_api_key_from_environment(monkeypatch):
    monkeypatch.setenv("MINISGL_API_KEY", "from-env")
    monkeypatch.setattr(args, "ENV", Env.read())
    assert args.parse_args([]).api_key == "from-env"
    assert args.parse_args(["--api-key", "flag"]).api_key == "flag"  # the flag wins
    monkeypatch.delenv("MINISGL_API_KEY")
    monkeypatch.setattr(args, "ENV", Env.read())
    assert args.parse_args([]).api_key is None


def test_empty_api_key_refused(capsys):
    with pytest.raises(SystemExit):
        args.parse_args(["--api-key", " "])
    assert "--api-key" in capsys.readouterr().err
