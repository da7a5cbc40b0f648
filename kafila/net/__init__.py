"""Member-side networking (docs/links.md): one UDP socket per member (`endpoint`), NAT
classification (`classify`), punching (`punch`), authenticated QUIC links with relay fallback
(`link`, `auth`), edge setup through signaling (`edge`) and the signaling client (`signaling`).
Nothing is imported here: import the module you need."""
