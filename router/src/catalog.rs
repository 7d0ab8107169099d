//! What the router knows of the cluster: every LLMService's served names and how it scales,
//! and the ready endpoints of its Service from the EndpointSlices, kept current by watching
//! both (kube's reflectors, no polling). Each change bumps a counter that wakes requests held
//! for a model without a ready replica.

use std::collections::BTreeSet;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;

use ferrite_crds::LLMService;
use futures::StreamExt;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::runtime::reflector::{self, Store};
use kube::runtime::{watcher, WatchStreamExt};
use kube::{Api, Client, ResourceExt};
use tokio::sync::watch;

/// The label the operator puts on an LLMService's Service, which its EndpointSlices carry too.
pub const LLMSERVICE_LABEL: &str = "serving.ferrite.dev/llmservice";
/// The label naming an EndpointSlice's Service.
const SERVICE_NAME_LABEL: &str = "kubernetes.io/service-name";
/// The engine Service's port name.
const PORT_NAME: &str = "http";

/// One ready engine.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Endpoint {
    /// Where it listens.
    pub addr: SocketAddr,
    /// Its pod, when the slice names it.
    pub pod: Option<String>,
}

/// An LLMService serving a model, as far as routing needs it.
#[derive(Debug, Clone, PartialEq)]
pub struct Backend {
    /// Its namespace.
    pub namespace: String,
    /// Its name (and its Service's).
    pub name: String,
    /// How it comes back from zero replicas.
    pub scaling: Scaling,
}

/// How an LLMService with no ready replica may get one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scaling {
    /// It scales from zero on demand (`autoscaling.minReplicas: 0`) and is at zero now: the
    /// router asks the operator for a replica.
    AtZero,
    /// It is meant to have replicas (they are starting, or being replaced): wait for them.
    Starting,
    /// It is held at zero replicas by its spec (`replicas: 0`, no autoscaling): nothing will
    /// start.
    Off,
}

/// Everything serving one model name.
#[derive(Debug, Clone, PartialEq)]
pub struct Route {
    /// The LLMServices answering to the name (usually one).
    pub backends: Vec<Backend>,
    /// Their ready endpoints, together.
    pub endpoints: Vec<Endpoint>,
}

/// The names an LLMService answers to: `spec.model.servedName` (or its name) and its aliases.
pub fn served_names(svc: &LLMService) -> Vec<String> {
    ferrite_crds::served_model_names(svc)
}

/// How `svc` gets a replica when it has none ready.
fn scaling(svc: &LLMService) -> Scaling {
    let desired = svc.status.as_ref().and_then(|s| s.desired_replicas);
    match &svc.spec.autoscaling {
        Some(a) if a.min_replicas == 0 && desired.unwrap_or(0) == 0 => Scaling::AtZero,
        Some(_) => Scaling::Starting,
        None if svc.spec.replicas == Some(0) => Scaling::Off,
        None => Scaling::Starting,
    }
}

/// The ready endpoints a slice lists, on its `http` port.
fn ready_endpoints(slice: &EndpointSlice) -> Vec<Endpoint> {
    let Some(port) = slice
        .ports
        .iter()
        .flatten()
        .find(|p| p.name.as_deref() == Some(PORT_NAME))
        .and_then(|p| p.port)
        .and_then(|p| u16::try_from(p).ok())
    else {
        return Vec::new();
    };
    slice
        .endpoints
        .iter()
        .filter(|e| {
            let c = e.conditions.as_ref();
            // An unset `ready` means ready (the API's rule); terminating endpoints are not.
            c.and_then(|c| c.ready).unwrap_or(true)
                && !c.and_then(|c| c.terminating).unwrap_or(false)
        })
        .filter_map(|e| {
            let ip: IpAddr = e.addresses.first()?.parse().ok()?;
            Some(Endpoint {
                addr: SocketAddr::new(ip, port),
                pod: e.target_ref.as_ref().and_then(|r| r.name.clone()),
            })
        })
        .collect()
}

/// The route of `model` among `services` and `slices`: `None` when no LLMService serves it.
pub fn route_of(
    services: &[Arc<LLMService>],
    slices: &[Arc<EndpointSlice>],
    model: &str,
) -> Option<Route> {
    let backends: Vec<Backend> = services
        .iter()
        .filter(|s| s.metadata.deletion_timestamp.is_none())
        .filter(|s| served_names(s).iter().any(|n| n == model))
        .map(|s| Backend {
            namespace: s.namespace().unwrap_or_default(),
            name: s.name_any(),
            scaling: scaling(s),
        })
        .collect();
    if backends.is_empty() {
        return None;
    }
    let endpoints: BTreeSet<Endpoint> = slices
        .iter()
        .filter(|slice| {
            let service = slice.labels().get(SERVICE_NAME_LABEL);
            let namespace = slice.namespace().unwrap_or_default();
            backends
                .iter()
                .any(|b| service == Some(&b.name) && namespace == b.namespace)
        })
        .flat_map(|slice| ready_endpoints(slice))
        .collect();
    Some(Route {
        backends,
        endpoints: endpoints.into_iter().collect(),
    })
}

/// The cluster as the watches last saw it.
#[derive(Clone)]
pub struct Catalog {
    services: Store<LLMService>,
    slices: Store<EndpointSlice>,
    changes: watch::Receiver<u64>,
}

impl std::fmt::Debug for Catalog {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Catalog")
            .field("services", &self.services.state().len())
            .field("slices", &self.slices.state().len())
            .finish()
    }
}

impl Catalog {
    /// Starts watching LLMServices and their EndpointSlices in `namespace` (all namespaces
    /// when `None`); the future drives the watches and must be polled (spawned).
    pub fn watch(
        client: Client,
        namespace: Option<&str>,
    ) -> (
        Catalog,
        impl std::future::Future<Output = ()> + Send + 'static,
    ) {
        let (llms, slices): (Api<LLMService>, Api<EndpointSlice>) = match namespace {
            Some(ns) => (
                Api::namespaced(client.clone(), ns),
                Api::namespaced(client, ns),
            ),
            None => (Api::all(client.clone()), Api::all(client)),
        };
        let (services, services_writer) = reflector::store();
        let (slice_store, slices_writer) = reflector::store();
        let (tx, changes) = watch::channel(0u64);
        let services_stream =
            reflector::reflector(services_writer, watcher(llms, watcher::Config::default()))
                .default_backoff()
                .touched_objects()
                .map(|_| ());
        let slices_stream = reflector::reflector(
            slices_writer,
            watcher(slices, watcher::Config::default().labels(LLMSERVICE_LABEL)),
        )
        .default_backoff()
        .touched_objects()
        .map(|_| ());
        let drive = futures::stream::select(services_stream, slices_stream).for_each(move |()| {
            tx.send_modify(|n| *n += 1);
            futures::future::ready(())
        });
        (
            Catalog {
                services,
                slices: slice_store,
                changes,
            },
            drive,
        )
    }

    /// Waits until both watches have listed what exists.
    pub async fn synced(&self) -> bool {
        self.services.wait_until_ready().await.is_ok()
            && self.slices.wait_until_ready().await.is_ok()
    }

    /// The route of `model`, or `None` when no LLMService serves it.
    pub fn route(&self, model: &str) -> Option<Route> {
        route_of(&self.services.state(), &self.slices.state(), model)
    }

    /// Every served name, sorted.
    pub fn models(&self) -> Vec<String> {
        let names: BTreeSet<String> = self
            .services
            .state()
            .iter()
            .filter(|s| s.metadata.deletion_timestamp.is_none())
            .flat_map(|s| served_names(s))
            .collect();
        names.into_iter().collect()
    }

    /// Every ready endpoint of every LLMService, for the load scrapes.
    pub fn all_endpoints(&self) -> Vec<Endpoint> {
        let endpoints: BTreeSet<Endpoint> = self
            .slices
            .state()
            .iter()
            .flat_map(|s| ready_endpoints(s))
            .collect();
        endpoints.into_iter().collect()
    }

    /// A receiver that changes whenever either watch sees a change.
    pub fn changes(&self) -> watch::Receiver<u64> {
        self.changes.clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn llms(name: &str, spec: serde_json::Value) -> Arc<LLMService> {
        let mut spec = spec;
        spec["model"]["source"] = json!("file:///models/m.gguf");
        Arc::new(
            serde_json::from_value(json!({
                "apiVersion": "serving.ferrite.dev/v1alpha1", "kind": "LLMService",
                "metadata": {"name": name, "namespace": "ml"}, "spec": spec,
            }))
            .expect("an LLMService"),
        )
    }

    fn slice(service: &str, endpoints: serde_json::Value) -> Arc<EndpointSlice> {
        Arc::new(
            serde_json::from_value(json!({
                "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
                "metadata": {"name": format!("{service}-abc"), "namespace": "ml",
                             "labels": {SERVICE_NAME_LABEL: service, LLMSERVICE_LABEL: service}},
                "addressType": "IPv4",
                "ports": [{"name": "http", "port": 8000, "protocol": "TCP"}],
                "endpoints": endpoints,
            }))
            .expect("a slice"),
        )
    }

    #[test]
    fn a_model_routes_to_the_ready_endpoints_of_the_llmservice_serving_it() {
        let services = vec![
            llms(
                "chat",
                json!({"model": {"servedName": "smol", "aliases": ["smol-latest"]}}),
            ),
            llms("other", json!({"model": {}})),
        ];
        let slices = vec![
            slice(
                "chat",
                json!([
                    {"addresses": ["10.0.0.1"], "conditions": {"ready": true},
                     "targetRef": {"kind": "Pod", "name": "chat-1"}},
                    {"addresses": ["10.0.0.2"], "conditions": {"ready": false}},
                    {"addresses": ["10.0.0.3"], "conditions": {"ready": true, "terminating": true}},
                    {"addresses": ["10.0.0.4"]},
                ]),
            ),
            slice("other", json!([{"addresses": ["10.0.0.9"]}])),
        ];
        let route = route_of(&services, &slices, "smol-latest").expect("served");
        assert_eq!(route.backends.len(), 1);
        assert_eq!(route.backends[0].name, "chat");
        let addrs: Vec<String> = route.endpoints.iter().map(|e| e.addr.to_string()).collect();
        assert_eq!(addrs, ["10.0.0.1:8000", "10.0.0.4:8000"]);
        assert_eq!(route.endpoints[0].pod.as_deref(), Some("chat-1"));
        assert_eq!(
            route_of(&services, &slices, "other").map(|r| r.endpoints.len()),
            Some(1)
        );
        assert_eq!(route_of(&services, &slices, "chat"), None, "served as smol");
    }

    #[test]
    fn how_a_service_without_replicas_comes_back_is_read_from_its_spec_and_status() {
        let auto = |min: i32| json!({"model": {}, "autoscaling": {"minReplicas": min, "maxReplicas": 2, "targetQueueDepth": 4}});
        let at_zero = llms("a", auto(0));
        assert_eq!(scaling(&at_zero), Scaling::AtZero);
        let mut scaled = (*at_zero).clone();
        scaled.status =
            Some(serde_json::from_value(json!({"desiredReplicas": 1})).expect("status"));
        assert_eq!(scaling(&scaled), Scaling::Starting);
        assert_eq!(scaling(&llms("b", auto(1))), Scaling::Starting);
        assert_eq!(
            scaling(&llms("c", json!({"model": {}, "replicas": 0}))),
            Scaling::Off
        );
        assert_eq!(scaling(&llms("d", json!({"model": {}}))), Scaling::Starting);
    }
}
