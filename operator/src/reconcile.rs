//! The reconcile loop: render the children of an LLMService, apply them with server-side apply,
//! read back what the cluster did, and write status and Events.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use ferrite_crds::{LLMService, LLMServiceStatus, ModelSource};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{Pod, Service};
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams};
use kube::runtime::controller::Action;
use kube::runtime::events::{Event, EventType, Recorder};
use kube::{Client, Resource, ResourceExt};
use serde_json::json;

use crate::metrics::Metrics;
use crate::render::{self, RenderConfig, LLMSERVICE_LABEL};
use crate::status::{self, Observed};
use crate::Error;

/// The field manager of everything the operator applies.
pub const FIELD_MANAGER: &str = "ferrite-operator";

/// What every reconcile shares.
pub struct Context {
    /// The API client.
    pub client: Client,
    /// Render settings (engine image, drain timeout).
    pub render: RenderConfig,
    /// Publishes Events on LLMServices.
    pub recorder: Recorder,
    /// The operator's metrics.
    pub metrics: Metrics,
    /// Consecutive failures per object, for the retry backoff.
    failures: Mutex<HashMap<String, u32>>,
}

impl Context {
    /// A context for a controller.
    pub fn new(client: Client, render: RenderConfig, recorder: Recorder, metrics: Metrics) -> Self {
        Self {
            client,
            render,
            recorder,
            metrics,
            failures: Mutex::default(),
        }
    }
}

fn key(svc: &LLMService) -> String {
    format!("{}/{}", svc.namespace().unwrap_or_default(), svc.name_any())
}

/// Replicas the operator wants now: the autoscaler's last decision (recorded in
/// `status.desiredReplicas`) when autoscaling is on, else `spec.replicas`.
pub fn desired_replicas(svc: &LLMService) -> i32 {
    match &svc.spec.autoscaling {
        Some(a) => svc
            .status
            .as_ref()
            .and_then(|s| s.desired_replicas)
            .unwrap_or_else(|| render::spec_replicas(svc))
            .clamp(a.min_replicas, a.max_replicas.max(a.min_replicas)),
        None => render::spec_replicas(svc),
    }
}

async fn publish(ctx: &Context, svc: &LLMService, type_: EventType, reason: &str, note: String) {
    let ev = Event {
        type_,
        reason: reason.to_string(),
        note: Some(note),
        action: reason.to_string(),
        secondary: None,
    };
    if let Err(e) = ctx.recorder.publish(&ev, &svc.object_ref(&())).await {
        tracing::warn!(error = %e, "could not publish an Event");
    }
}

async fn write_status(
    api: &Api<LLMService>,
    name: &str,
    status: &LLMServiceStatus,
) -> Result<(), Error> {
    let patch = json!({"status": status});
    api.patch_status(name, &PatchParams::default(), &Patch::Merge(&patch))
        .await?;
    Ok(())
}

/// One reconcile of one LLMService.
pub async fn reconcile(svc: Arc<LLMService>, ctx: Arc<Context>) -> Result<Action, Error> {
    let started = Instant::now();
    let result = reconcile_inner(&svc, &ctx).await;
    ctx.metrics
        .duration
        .with_label_values(&[] as &[&str])
        .observe(started.elapsed().as_secs_f64());
    match &result {
        Ok(_) => {
            ctx.metrics.reconciles.with_label_values(&["ok"]).inc();
            if let Ok(mut f) = ctx.failures.lock() {
                f.remove(&key(&svc));
            }
        }
        Err(e) => {
            ctx.metrics.reconciles.with_label_values(&["error"]).inc();
            ctx.metrics.errors.with_label_values(&[e.kind()]).inc();
            record_error(&svc, &ctx, e).await;
        }
    }
    result
}

/// Records a failed reconcile in status (`Ready=False`, reason `ReconcileError`) and an Event.
async fn record_error(svc: &LLMService, ctx: &Context, e: &Error) {
    tracing::warn!(llmservice = %key(svc), error = %e, "reconcile failed");
    publish(
        ctx,
        svc,
        EventType::Warning,
        "ReconcileError",
        e.to_string(),
    )
    .await;
    let (Some(ns), name) = (svc.namespace(), svc.name_any()) else {
        return;
    };
    let api = Api::<LLMService>::namespaced(ctx.client.clone(), &ns);
    let mut new_status = svc.status.clone().unwrap_or_default();
    let ready = status::condition(
        &new_status.conditions,
        "Ready",
        false,
        "ReconcileError",
        format!("the operator could not apply this LLMService (retrying): {e}"),
        svc.metadata.generation,
        Timestamp::now(),
    );
    new_status.conditions.retain(|c| c.type_ != "Ready");
    new_status.conditions.insert(0, ready);
    let _ = write_status(&api, &name, &new_status).await;
}

/// The retry policy: exponential backoff from 2 s up to 5 minutes per object.
pub fn error_policy(svc: Arc<LLMService>, _e: &Error, ctx: Arc<Context>) -> Action {
    let n = ctx
        .failures
        .lock()
        .map(|mut f| {
            let n = f.entry(key(&svc)).or_insert(0);
            *n = n.saturating_add(1);
            *n
        })
        .unwrap_or(1);
    let secs = 2u64.saturating_pow(n.min(9)).min(300);
    Action::requeue(Duration::from_secs(secs))
}

async fn reconcile_inner(svc: &LLMService, ctx: &Context) -> Result<Action, Error> {
    let ns = svc
        .namespace()
        .ok_or(Error::MissingField("metadata.namespace"))?;
    let name = svc.name_any();
    if svc.meta().deletion_timestamp.is_some() {
        // Owner references let the garbage collector remove the children.
        return Ok(Action::await_change());
    }
    let client = &ctx.client;
    let llms = Api::<LLMService>::namespaced(client.clone(), &ns);

    let m = &svc.spec.model;
    if let Err(e) = ModelSource::parse(&m.source, m.revision.as_deref()) {
        let mut st = status::compute(svc, 0, &Observed::default(), Timestamp::now());
        st.phase = Some("Failed".into());
        if let Some(c) = st.conditions.iter_mut().find(|c| c.type_ == "Ready") {
            c.reason = "InvalidSpec".into();
            c.message = e.to_string();
        }
        if svc.status.as_ref().map(status::comparable) != Some(status::comparable(&st)) {
            publish(ctx, svc, EventType::Warning, "InvalidSpec", e.to_string()).await;
            write_status(&llms, &name, &st).await?;
        }
        return Ok(Action::await_change());
    }

    let desired = desired_replicas(svc);
    let apply = PatchParams::apply(FIELD_MANAGER).force();

    let deployments = Api::<Deployment>::namespaced(client.clone(), &ns);
    let before = deployments.get_opt(&name).await?;
    let wanted = render::deployment(svc, &ctx.render, desired)?;
    let after = deployments
        .patch(&name, &apply, &Patch::Apply(&wanted))
        .await?;
    match &before {
        None => {
            let note = format!("created Deployment {name} with {desired} replica(s)");
            publish(ctx, svc, EventType::Normal, "Created", note).await;
        }
        Some(b) if b.metadata.generation != after.metadata.generation => {
            let old_t = b.spec.as_ref().map(|s| &s.template);
            let new_t = after.spec.as_ref().map(|s| &s.template);
            let old_r = b.spec.as_ref().and_then(|s| s.replicas).unwrap_or(1);
            if old_t != new_t {
                let note =
                    format!("rolling Deployment {name}: the model, engine settings or pod changed");
                publish(ctx, svc, EventType::Normal, "RolloutStarted", note).await;
            } else if old_r != desired {
                let note = format!("scaled Deployment {name} {old_r} -> {desired}");
                publish(ctx, svc, EventType::Normal, "Scaled", note).await;
            } else {
                let note = format!("updated Deployment {name}");
                publish(ctx, svc, EventType::Normal, "Updated", note).await;
            }
        }
        Some(_) => {}
    }

    let services = Api::<Service>::namespaced(client.clone(), &ns);
    let svc_existed = services.get_opt(&name).await?.is_some();
    services
        .patch(&name, &apply, &Patch::Apply(&render::service(svc)?))
        .await?;
    if !svc_existed {
        let note = format!("created Service {name} (port 8000, http)");
        publish(ctx, svc, EventType::Normal, "Created", note).await;
    }

    let pdbs = Api::<PodDisruptionBudget>::namespaced(client.clone(), &ns);
    match render::pdb(svc, desired)? {
        Some(p) => {
            pdbs.patch(&name, &apply, &Patch::Apply(&p)).await?;
        }
        None => match pdbs.delete(&name, &DeleteParams::default()).await {
            Ok(_) => {}
            Err(kube::Error::Api(s)) if s.code == 404 => {}
            Err(e) => return Err(e.into()),
        },
    }

    let pods = Api::<Pod>::namespaced(client.clone(), &ns)
        .list(&ListParams::default().labels(&format!("{LLMSERVICE_LABEL}={name}")))
        .await?
        .items;
    let observed = Observed {
        deployment: Some(after),
        pods,
    };
    let st = status::compute(svc, desired, &observed, Timestamp::now());
    let old = svc.status.clone().unwrap_or_default();
    if status::comparable(&old) != status::comparable(&st) {
        if old.phase != st.phase {
            let ready = st.conditions.iter().find(|c| c.type_ == "Ready");
            let msg = ready.map(|c| c.message.clone()).unwrap_or_default();
            let phase = st.phase.clone().unwrap_or_default();
            let (t, reason) = match phase.as_str() {
                "Failed" => (
                    EventType::Warning,
                    ready.map(|c| c.reason.as_str()).unwrap_or("Failed"),
                ),
                "Degraded" => (EventType::Warning, "Degraded"),
                _ => (EventType::Normal, "PhaseChanged"),
            };
            publish(ctx, svc, t, reason, format!("{phase}: {msg}")).await;
        }
        write_status(&llms, &name, &st).await?;
    }
    let ready = st.phase.as_deref() == Some("Ready");
    Ok(Action::requeue(Duration::from_secs(if ready {
        300
    } else {
        15
    })))
}
