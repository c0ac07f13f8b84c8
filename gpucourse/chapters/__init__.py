"""One module a chapter: the tables and figures a chapter shows from its runs, named by its notebook's number
(`ch07` for `notebooks/07_zero_and_fsdp.ipynb`, `ch07b` for 07b). A chapter imports its own by one short name:

    from gpucourse.chapters import ch07
    ch07.memory_per_rank(rows)

The layer above `viz/` (whose `tables.Table`, `plots.run_label` and shared charts they use) and below `tools/`;
chapter modules never import each other: what two chapters show goes down into `viz/`.
"""
