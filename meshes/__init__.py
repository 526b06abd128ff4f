"""Machine topologies, device meshes, collective scopes and parallel strategies as sharding rules."""
