"""Nodes added to a running roster (a reload: ZoneComponent.reload_keys): every index a reader
holds is updated in place, the new nodes start unknown (probed optimistically, as at start),
and a node id or address already listed is refused with nothing added."""

from __future__ import annotations

import pytest

from laminar.zone.membership import Member, Membership, MembershipError


def roster() -> Membership:
    return Membership(1, [Member(1, 1, "10.0.0.1", 7440, pool="training"), Member(2, 1, "10.0.0.2", 7440),
                          Member(4, 2, "10.0.0.4", 7440)])


def test_added_nodes_join_every_index_in_place_and_start_unknown() -> None:
    m = roster()
    zone1, training = m.zone_list(1), m.pool_list(1, "training")  # lists a reader holds on to
    assert m.add([Member(3, 1, "10.0.0.3", 7440, pool="training"), Member(5, 3, "10.0.0.5", 7440)]) == [3, 5]
    assert zone1 == [1, 2, 3] and m.zone_list(1) is zone1  # the same list, sorted
    assert training == [1, 3] and m.pool_list(1, "training") is training
    assert m.zones() == [1, 2, 3] and m.zone_list(3) == [5]
    assert m.zone_of() == {1: 1, 2: 1, 3: 1, 4: 2, 5: 3}
    assert m.udp_sources()[3] == ("10.0.0.3", 7440) and m.tcp_sources()[5] == "10.0.0.5"
    assert m.by_addr[("10.0.0.3", 7440)] == 3 and [x.node for x in m.members] == [1, 2, 4, 3, 5]
    assert m.zone_members(1, alive_only=True, now=0.0) == [2, 3]  # never heard from: probed
    m.seen(3, now=1.0)
    assert m.state[3].rx == 1 and [p["node"] for p in m.peers(1.0)] == [1, 2, 3, 4, 5]


@pytest.mark.parametrize(("new", "error"), [
    ([Member(2, 1, "10.0.0.9", 7440)], "node id 2 listed twice"),
    ([Member(3, 1, "10.0.0.3", 7440), Member(3, 1, "10.0.0.6", 7440)], "node id 3 listed twice"),
    ([Member(3, 1, "10.0.0.2", 7440)], "node 3's address 10.0.0.2:7440 is another node's too"),
    ([Member(3, 1, "10.0.0.3", 7440), Member(5, 1, "10.0.0.3", 7440)], "node 3's address 10.0.0.3:7440"),
])
def test_a_node_id_or_address_listed_already_is_refused_with_nothing_added(new: list[Member], error: str) -> None:
    m = roster()
    with pytest.raises(MembershipError, match=error.replace("(", r"\(")):
        m.add(new)
    assert sorted(m.by_node) == [1, 2, 4] and m.zone_list(1) == [1, 2] and sorted(m.state) == [1, 2, 4]
