"""Seeing the plane: `plane breathe` (is the GPU breathing?), `plane status` / `plane top`
(what every router and node says of itself). Tools: they read the contract and the
plane's endpoints, never the router's or the node's insides (docs/observability.md)."""
