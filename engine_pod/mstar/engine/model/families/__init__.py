"""One file per model family: what is its own (config fields, checkpoint names); see
`mstar.engine.model.family.Family` and the registry."""
