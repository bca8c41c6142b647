"""Layer 1, numerics: the format table (SPEC 1), the choice lists and argument checks, the packed layout (SPEC 6),
the codec (SPEC 4, 5), Philox and the group scales (SPEC 3), in plain Python and torch."""
