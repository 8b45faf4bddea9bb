"""laminarctl's exit codes against a real laminard: a command that did not get what it asked
for never exits 0.

``events --follow`` used to exit 0 when the agent went away (stopped, restarted, killed): the
stream just ended, and a script watching the exit code took the end of its event feed for
success. The agent never ends a follow itself (it sends keepalives), so the end is now exit 3
with the ``--since`` id to go on from.
"""

from __future__ import annotations

import json
import select
import subprocess

import pytest
from agentproc import VENV_BIN, AgentProc, wait_until

pytestmark = pytest.mark.kernel


@pytest.mark.parametrize("how", ["stop", "kill9"])
def test_events_follow_is_not_success_when_the_agent_goes_away(agent: AgentProc, how: str) -> None:
    follow = subprocess.Popen(agent.argv(str(VENV_BIN / "laminarctl"), "--socket", str(agent.sock), "-o", "json",
                                         "events", "--follow"),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        # the stream is live once it shows an event made after it started
        assert follow.stdout is not None

        def shown() -> bool:
            agent.ctl("submit", "--", "/bin/true")
            return select.select([follow.stdout], [], [], 1.0)[0] != []

        wait_until(shown, 60, "the follow to show an event")
        line = follow.stdout.readline()
        assert line, (follow.poll(), follow.stderr.read() if follow.poll() is not None else "")
        assert json.loads(line)["kind"]  # a job's, or another (pressure: node-wide)
        assert follow.poll() is None
        if how == "stop":
            # the agent stops by itself on SIGTERM, the follower's stream open (it sat in its
            # stop until AgentProc's SIGKILL 30 s later: the stream swallowed its cancellation)
            assert agent.stop() == 0, "laminard did not exit on SIGTERM while events --follow was open"
        else:
            agent.kill9()
        out, err = follow.communicate(timeout=60)
    finally:
        if follow.poll() is None:
            follow.kill()
            follow.wait(10)
    assert follow.returncode == 3, (follow.returncode, err)
    assert "closed the event stream" in err and "--since" in err, err
