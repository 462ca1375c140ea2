"""Expert-parallel dispatch/combine backends (local, all_to_all, hierarchical, deepep).

Not built yet: the walking skeleton trains with the transformers MoE block in one process.
See DESIGN.md, "Expert-parallel dispatch/combine".
"""
