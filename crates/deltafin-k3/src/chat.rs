//! XTML chat format (spec §8).
