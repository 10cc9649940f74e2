//! Route observers: what watches the routes the model takes (the heat histogram, the router
//! trace) without serving or scheduling any expert. The model holds a [`RouteObservers`]
//! list and hands it every MoE pass's routes, right before it tells its expert source the
//! pass's route union ([`crate::ExpertSource::begin_layer`]).

/// The routes of one pass at one MoE layer.
#[derive(Clone, Copy, Debug)]
pub struct PassRoutes<'a> {
    /// MoE layer.
    pub layer: usize,
    /// Routed experts per row.
    pub k: usize,
    /// Row `r` chose `ids[r·k..(r+1)·k]`, in the authoritative order (descending router
    /// score).
    pub ids: &'a [usize],
    /// The router weights of `ids`, element for element.
    pub weights: &'a [f32],
    /// The union of `ids`: ascending, no duplicates.
    pub union: &'a [usize],
}

/// Something that watches the routes. A layer at or below the previous observed one starts
/// a new pass. Observing never fails: a recorder that cannot write warns and carries on.
pub trait RouteObserver: Send + Sync {
    /// One pass's routes at one MoE layer.
    fn observe(&self, routes: &PassRoutes<'_>);
}

/// The observers of a model, called in the order they were added.
#[derive(Default)]
pub struct RouteObservers(Vec<Box<dyn RouteObserver>>);

impl RouteObservers {
    /// Add `observer` after the ones already here.
    pub fn push(&mut self, observer: Box<dyn RouteObserver>) {
        self.0.push(observer);
    }

    /// Whether no observer is attached (the model then skips assembling [`PassRoutes`]).
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Observers attached.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// Hand `routes` to every observer.
    pub fn observe(&self, routes: &PassRoutes<'_>) {
        for o in &self.0 {
            o.observe(routes);
        }
    }
}

impl std::fmt::Debug for RouteObservers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "RouteObservers({} attached)", self.0.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::{Arc, Mutex};

    struct Log(Arc<Mutex<Vec<(usize, usize)>>>, usize);
    impl RouteObserver for Log {
        fn observe(&self, r: &PassRoutes<'_>) {
            self.0.lock().unwrap().push((self.1, r.layer));
        }
    }

    #[test]
    fn every_observer_sees_every_pass_in_order() {
        let seen = Arc::new(Mutex::new(Vec::new()));
        let mut list = RouteObservers::default();
        assert!(list.is_empty());
        list.push(Box::new(Log(seen.clone(), 0)));
        list.push(Box::new(Log(seen.clone(), 1)));
        assert_eq!(list.len(), 2);
        for layer in [1, 2] {
            list.observe(&PassRoutes {
                layer,
                k: 1,
                ids: &[3],
                weights: &[1.0],
                union: &[3],
            });
        }
        assert_eq!(*seen.lock().unwrap(), [(0, 1), (1, 1), (0, 2), (1, 2)]);
    }
}
