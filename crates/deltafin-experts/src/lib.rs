//! `deltafin-experts`: routed-expert storage for K3.
//!
//! Locates each expert's six byte ranges (MXFP4 codes and E8M0 scales of w1/w2/w3), reads
//! them explicitly from disk under a RAM budget, caches hot experts and prefetches the next
//! layer's likely picks. The model never touches expert bytes except through this crate.
