"""Stream sources as a server takes them (``app.source_urls`` and the server's
``check_stream_source``): what FFmpeg and a camera could read differently from the check is
refused, naming the culprit; what passes is one spelling, the same when checked again; and
credentials are never shown."""

from __future__ import annotations

import re
from urllib.parse import urlsplit

import pytest

from app.errors import InvalidParameter
from app.ipc.streams import check_stream_source
from app.settings import Settings
from app.source_urls import parse_url, redact


@pytest.mark.parametrize("source, named", [
    ("rtsp://cam/a\rX-Injected: 1", "U+000D (CARRIAGE RETURN) at position 12"),
    ("rtsp://cam/a\x00b", "U+0000 (NULL) at position 12"),
    ("rtsp://cam/a\tb", "U+0009 (CHARACTER TABULATION)"),
    ("rtsp://cam/a\nb", "U+000A (LINE FEED)"),
    ("rtsp://cam/a\x7fb", "U+007F (DELETE)"),
    ("rtsp://cam/a\x1bb", "U+001B"),
    ("rtsp://cam/a b", "U+0020 (SPACE)"),
    (" rtsp://cam/a", "U+0020 (SPACE) at position 0"),
    ("rtsp://cam/a\n", "U+000A (LINE FEED) at position 12"),
    ("rtsp://cam/a\u00a0", "U+00A0 (NO-BREAK SPACE)"),
    ("rtsp://cam/a\u2028", "U+2028 (LINE SEPARATOR)"),
    ("rtsp://cam/a\u200bb", "U+200B (ZERO WIDTH SPACE)"),
    ("rtsp://cam/a\u202eb", "U+202E (RIGHT-TO-LEFT OVERRIDE)"),
    ("rtsp://cam/a\x85b", "U+0085"),
    ("clip\x00.avi", "U+0000 (NULL) at position 4"),  # a file path too
])
def test_control_characters_and_whitespace_are_refused_by_name(source, named):
    with pytest.raises(InvalidParameter, match=re.escape(named)):
        check_stream_source(source, Settings())


@pytest.mark.parametrize("source, why", [
    ("rtsp://cam/a#frag", "fragment"),
    ("rtsp://user@evil.com@cam/a", "more than one '@'"),
    ("rtsp://u:p@ss@cam/a", "more than one '@'"),
    ("rtsp://[fe80::1%25eth0]:554/a", "IPv6 zone"),
    ("rtsp://[fe80::1%eth0]/a", "IPv6 zone"),
    ("rtsp://[::1/a", "no closing"),
    ("rtsp://[not:an:address]/a", "not a valid IPv6"),
    ("rtsp://[::1]x/a", "not a port"),
    ("rtsp://\u0435xample.com/a", "non-ASCII character U\\+0435"),  # a Cyrillic lookalike
    ("rtsp://ｅxample.com/a", "non-ASCII"),  # fullwidth: IDNA would map it to ASCII
    ("rtsp://cam/caf\u00e9", "non-ASCII"),
    ("rtsp://cam\\@evil/a", "'\\\\\\\\'"),
    ("http://cam/a|b", "'\\|'"),
    ("http://cam/a<b>", "'<'"),
    ("rtsp://cam/%zz", "bad %-escape"),
    ("rtsp://us%zzer@cam/a", "bad %-escape"),
    ("rtsp:///a", "names no host"),
    ("rtsp://:554/a", "names no host"),
    ("rtsp://-cam/a", "not a valid host name"),
    ("rtsp://cam..x/a", "not a valid host name"),
    ("rtsp://" + "a" * 64 + "/a", "not a valid host name"),
    ("rtsp://cam:0/a", "port"),
    ("rtsp://cam:65536/a", "port"),
    ("rtsp://cam:/a", "port"),
    ("rtsp://cam:55x/a", "port"),
    ("rtsp://cam:1:2/a", "port"),
    ("file:///etc/passwd", "scheme not allowed"),
    ("rtsp+tcp://cam/a", "scheme not allowed"),
    ("a" * 300 + "://cam/a", "scheme not allowed"),
    ("udp://cam:1234", "scheme not allowed"),
    ("rtsp://cam/" + "a" * 2100, "at most 2048"),
])
def test_urls_that_could_be_read_two_ways_are_refused(source, why):
    with pytest.raises(InvalidParameter, match=why):
        check_stream_source(source, Settings())


@pytest.mark.parametrize("source, normalised", [
    ("RTSP://Cam.Local:0554/Live/Stream1?channel=1&subtype=0", "rtsp://cam.local:554/Live/Stream1?channel=1&subtype=0"),
    ("rtsp://cam:000008554/a", "rtsp://cam:8554/a"),
    ("rtsp://admin:s%40cret@10.0.0.7/h264", "rtsp://admin:s%40cret@10.0.0.7/h264"),
    ("rtsp://[0:0::1]:8554/a", "rtsp://[::1]:8554/a"),
    ("HTTPS://cam.example/mjpg/video.mjpg", "https://cam.example/mjpg/video.mjpg"),
    ("rtmp://xn--e1afmkfd.xn--p1ai/live", "rtmp://xn--e1afmkfd.xn--p1ai/live"),
    ("srt://cam:9000?streamid=a", "srt://cam:9000?streamid=a"),
    ("rtsp://cam", "rtsp://cam"),
    ("rtsp://cam/a%0D%0Ab", "rtsp://cam/a%0D%0Ab"),  # encoded: it reaches the camera as three bytes, no line break
])
def test_a_checked_url_has_one_spelling_which_checks_again_as_itself(source, normalised):
    assert check_stream_source(source, Settings()) == normalised
    assert check_stream_source(normalised, Settings()) == normalised


def test_the_host_checked_is_the_host_a_url_parser_finds():
    """What Python's own URL parser reads from every accepted URL agrees with the check."""
    for source in ("rtsp://a:b@cam.local:554/x?y=1", "rtsp://[::1]:554/x", "http://cam/x;y=1@z"):
        url, split = parse_url(source), urlsplit(source)
        assert (url.host, url.port) == (split.hostname, split.port)


@pytest.mark.parametrize("source, shown", [
    ("rtsp://admin:secret@cam.local:554/live", "rtsp://***@cam.local:554/live"),
    ("rtsp://admin@cam/live", "rtsp://***@cam/live"),
    ("rtsp://:secret@cam/live", "rtsp://***@cam/live"),
    ("rtsp://a@b@cam/live", "rtsp://***@cam/live"),  # unchecked (the CLI's own sources): the last '@' wins
    ("rtsp://cam/live@noon", "rtsp://cam/live@noon"),  # an '@' in the path is no user name
    ("rtsp://cam/live", "rtsp://cam/live"),
    ("/videos/a.avi", "/videos/a.avi"),
])
def test_redaction_hides_user_names_and_passwords(source, shown):
    assert redact(source) == shown
    if "@" in source.split("/")[2] and source.count("@") == 1:
        assert parse_url(source).shown == shown


def test_file_sources_resolve_under_the_root_only(tmp_path):
    (tmp_path / "clip.avi").write_bytes(b"x")
    settings = Settings(stream_files_root=tmp_path)
    assert check_stream_source("clip.avi", settings) == str(tmp_path / "clip.avi")
    assert check_stream_source(str(tmp_path / "clip.avi"), settings) == str(tmp_path / "clip.avi")
    for escape in ("../clip.avi", "/etc/passwd", "-i clip.avi", "|clip.avi", "concat:clip.avi|clip.avi"):
        with pytest.raises(InvalidParameter):
            check_stream_source(escape, settings)
