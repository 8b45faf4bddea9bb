"""Laminar's network mechanism through netlink (:mod:`laminar.net.rtnl`): clsact and tc BPF filters
(:mod:`laminar.net.tc`), HTB classes and the shaper, and the kill-switch that drives netguard."""
