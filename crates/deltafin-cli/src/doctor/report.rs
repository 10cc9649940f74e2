//! The doctor's report: checks with a status, a fix for each failure, and facts.

use serde_json::Value;

/// Outcome of one check.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Status {
    Ok,
    Info,
    Warn,
    Fail,
}

impl Status {
    pub fn as_str(self) -> &'static str {
        match self {
            Status::Ok => "ok",
            Status::Info => "info",
            Status::Warn => "warn",
            Status::Fail => "fail",
        }
    }
}

/// One line of the report.
#[derive(Clone, Debug)]
pub struct Check {
    pub name: String,
    pub status: Status,
    pub detail: String,
    pub fix: Option<String>,
}

#[derive(Default)]
pub struct Report {
    pub checks: Vec<Check>,
    pub model_contract: Option<String>,
    /// Number of checks printed before the model contract line.
    pub contract_after: usize,
    pub admitted_context: Option<u64>,
    pub facts: serde_json::Map<String, Value>,
}

impl Report {
    fn push(&mut self, name: String, status: Status, detail: String, fix: Option<String>) {
        self.checks.push(Check {
            name,
            status,
            detail,
            fix,
        });
    }

    pub fn add(&mut self, name: impl Into<String>, status: Status, detail: impl Into<String>) {
        self.push(name.into(), status, detail.into(), None);
    }

    /// A failure (a problem: the exit status becomes 1) with what to do about it.
    pub fn fail(
        &mut self,
        name: impl Into<String>,
        detail: impl Into<String>,
        fix: impl Into<String>,
    ) {
        self.push(name.into(), Status::Fail, detail.into(), Some(fix.into()));
    }

    /// A warning with a suggestion (it does not count as a problem).
    pub fn warn(
        &mut self,
        name: impl Into<String>,
        detail: impl Into<String>,
        fix: impl Into<String>,
    ) {
        self.push(name.into(), Status::Warn, detail.into(), Some(fix.into()));
    }

    pub fn problems(&self) -> usize {
        self.checks
            .iter()
            .filter(|c| c.status == Status::Fail)
            .count()
    }
}
