"""The pure decisions of a reclaim carried out through a scheduler and of the last checkpoint
published to it (:mod:`laminar.policy.sched_reclaim`), in memory."""

from __future__ import annotations

import math

import pytest

from laminar.policy import sched_reclaim as sr


def test_publish_text_is_the_whole_seconds_and_the_path() -> None:
    assert sr.publish_text(1765000000.9, "/shared/slurm-12/ckpt-40") == "laminar-ckpt=1765000000 /shared/slurm-12/ckpt-40"
    assert sr.publish_text(5) == "laminar-ckpt=5"
    assert sr.parse_published("laminar-ckpt=5 /a b/ckpt-1") == (5, "/a b/ckpt-1")
    # a newline in a path would break scontrol's one line per job: replaced; a long one cut
    assert "\n" not in sr.publish_text(1, "/x\n/y")
    assert len(sr.publish_text(1, "/" + "a" * 5000)) <= len("laminar-ckpt=1 ") + sr.PATH_MAX
    for bad in (-1, math.nan, math.inf, True, "12"):
        with pytest.raises(ValueError, match="checkpoint time"):
            sr.publish_text(bad)  # type: ignore[arg-type]


def test_merge_comment_keeps_the_users_words_and_replaces_ours() -> None:
    ours = sr.publish_text(100, "/c/ckpt-1")
    assert sr.merge_comment(None, ours) == ours
    assert sr.merge_comment("", ours) == ours
    assert sr.merge_comment("my run 3", ours) == "my run 3; " + ours
    again = sr.merge_comment(sr.merge_comment("my run 3", ours), sr.publish_text(200, "/c/ckpt-2"))
    assert again == "my run 3; laminar-ckpt=200 /c/ckpt-2"
    assert sr.merge_comment(sr.publish_text(1), ours) == ours  # only ours there: replaced, nothing in front
    assert sr.parse_published(again) == (200, "/c/ckpt-2")
    assert sr.parse_published("my run 3") is None
    # a user's long comment is cut so the whole stays within COMMENT_MAX
    assert len(sr.merge_comment("u" * 10_000, ours)) <= sr.COMMENT_MAX
    assert sr.merge_comment("u" * 10_000, ours).endswith(ours)


def test_should_publish_only_news() -> None:
    assert not sr.should_publish(None, None)
    assert sr.should_publish(None, 10.0)
    assert not sr.should_publish(10.0, 10.5)  # the same whole second as published
    assert sr.should_publish(10.0, 11.0)
    assert not sr.should_publish(11.0, 10.0)


def test_drain_reason_is_ours_and_bounded() -> None:
    r = sr.drain_reason("lmt1", "owner needs it\nback")
    assert r == "laminar: reclaim of node lmt1: owner needs it back"
    assert sr.drained_by_us(r)
    assert not sr.drained_by_us("disk replaced by ops")
    assert not sr.drained_by_us(None)
    assert len(sr.drain_reason("n", "x" * 1000)) == sr.REASON_MAX


def test_ckpt_wait_leaves_the_give_back_its_time() -> None:
    assert sr.ckpt_wait_s(100.0, 130.0, 12.0) == 18.0
    assert sr.ckpt_wait_s(100.0, 105.0, 12.0) == 0.0  # too short a window: given back at once
    assert sr.ckpt_wait_s(100.0, 130.0, -5.0) == 30.0
