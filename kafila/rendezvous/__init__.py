"""The always-on rendezvous: signaling, NAT probes, relay (imports no torch or MLX).

Pure cores: `registry.Registry` (sessions, presence, codes, join limits) and `relay.RelayTable`
(channels, legs, forwarding). Shells: `udp.UdpService`, `app.build_app`, `server.RendezvousServer`.
See docs/rendezvous.md.
"""
