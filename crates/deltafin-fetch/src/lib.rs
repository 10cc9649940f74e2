//! `deltafin-fetch`: pinned, parallel, resumable and verified downloads of the K3, DSpark
//! and Qwen3 files, and the `setup` family of commands that plan and perform installs.
