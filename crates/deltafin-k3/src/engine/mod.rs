//! The engine: one load path for every caller (the `deltafin` commands, the OpenAI server,
//! a program that embeds K3).
//!
//! An [`EngineConfig`] says what is wanted (memory budget, spine format, device, scale4,
//! streaming, heat, router trace, huge pages); [`EngineBuilder`] opens the install, plans
//! the memory ([`plan::plan_memory`], a pure function of sizes), assembles the routed-expert
//! stack ([`experts`]), loads the model and places it ([`placement`]). Nothing here reads
//! the environment or prints: the caller maps its own settings onto the config and receives
//! the startup lines through [`LoadProgress`].

pub mod builder;
pub mod config;
pub mod error;
pub mod experts;
pub mod host;
pub mod placement;
pub mod plan;
pub mod progress;

pub use builder::{EngineBuilder, LoadedEngine, check_spine};
pub use config::{
    CONTEXT_RESERVE_TOKENS, DEVICE_RESERVE_GB, EngineConfig, HeatSettings, RouterTraceRequest,
    Scale4Mode,
};
pub use error::{BoxError, EngineError};
pub use experts::{ExpertLayer, ExpertLayerFactory};
pub use placement::{DeviceRequest, ExpertBackendRequest, Placement};
pub use plan::{MemoryPlan, PlanError, PlanInputs, plan_memory};
pub use progress::{LoadProgress, Silent};
