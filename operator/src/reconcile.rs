//! The reconcile loop: render the children of an LLMService (a Deployment, or a
//! LeaderWorkerSet when its model is split into pipeline stages), apply them with server-side
//! apply, read back what the cluster did, and write status and Events.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use ferrite_crds::{LLMService, LLMServiceStatus, ModelSource};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{Pod, Secret, Service};
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, DeleteParams, DynamicObject, ListParams, Patch, PatchParams, PostParams};
use kube::runtime::controller::Action;
use kube::runtime::events::{Event, EventType, Recorder};
use kube::{Client, Resource, ResourceExt};
use serde_json::json;

use crate::metrics::Metrics;
use crate::render::{self, RenderConfig};
use crate::status::{self, Observed, WorkloadStatus};
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

    let workload = if render::uses_groups(svc) {
        if !leaderworkerset_installed(client).await? {
            return lws_missing(svc, ctx, &llms, &name).await;
        }
        apply_groups(svc, ctx, &ns, &name, desired).await?
    } else {
        apply_deployment(svc, ctx, &ns, &name, desired).await?
    };

    let services = Api::<Service>::namespaced(client.clone(), &ns);
    let svc_existed = services.get_opt(&name).await?.is_some();
    services
        .patch(&name, &apply, &Patch::Apply(&render::service(svc)?))
        .await?;
    if !svc_existed {
        let note = format!("created Service {name} (port 8000, http)");
        publish(ctx, svc, EventType::Normal, "Created", note).await;
    }

    sync_inference_pool(svc, ctx, &ns, &name).await?;

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
        .list(&ListParams::default().labels(&render::engine_pods_selector(&name)))
        .await?
        .items;
    let observed = Observed {
        workload: Some(workload),
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

/// Publishes what applying a workload did: created it, started a rollout, scaled it, or
/// changed something else in it (`kind` and `name` say which object).
#[allow(clippy::too_many_arguments)]
async fn announce<T: PartialEq>(
    ctx: &Context,
    svc: &LLMService,
    kind: &str,
    name: &str,
    unit: &str,
    existed: Option<(Option<i64>, T, i32)>,
    after: (Option<i64>, T),
    desired: i32,
) {
    let note = match existed {
        None => Some((
            "Created",
            format!("created {kind} {name} with {desired} {unit}"),
        )),
        Some((generation, _, _)) if generation == after.0 => None,
        Some((_, template, _)) if template != after.1 => Some((
            "RolloutStarted",
            format!("rolling {kind} {name}: the model, engine settings or pod changed"),
        )),
        Some((_, _, old)) if old != desired => {
            Some(("Scaled", format!("scaled {kind} {name} {old} -> {desired}")))
        }
        Some(_) => Some(("Updated", format!("updated {kind} {name}"))),
    };
    if let Some((reason, note)) = note {
        publish(ctx, svc, EventType::Normal, reason, note).await;
    }
}

/// Applies the Deployment of an LLMService whose replicas are single pods, and removes the
/// LeaderWorkerSet it had while it was split into stages once the Deployment serves every
/// replica (so a switch never serves fewer replicas than before).
async fn apply_deployment(
    svc: &LLMService,
    ctx: &Context,
    ns: &str,
    name: &str,
    desired: i32,
) -> Result<WorkloadStatus, Error> {
    let client = &ctx.client;
    let apply = PatchParams::apply(FIELD_MANAGER).force();
    let deployments = Api::<Deployment>::namespaced(client.clone(), ns);
    let before = deployments.get_opt(name).await?;
    let wanted = render::deployment(svc, &ctx.render, desired)?;
    let after = deployments
        .patch(name, &apply, &Patch::Apply(&wanted))
        .await?;
    let template = |d: &Deployment| d.spec.as_ref().map(|s| s.template.clone());
    announce(
        ctx,
        svc,
        "Deployment",
        name,
        "replica(s)",
        before.as_ref().map(|b| {
            let replicas = b.spec.as_ref().and_then(|s| s.replicas).unwrap_or(1);
            (b.metadata.generation, template(b), replicas)
        }),
        (after.metadata.generation, template(&after)),
        desired,
    )
    .await;
    let workload = WorkloadStatus::of_deployment(&after);
    if workload.complete(desired) && leaderworkerset_installed(client).await? {
        let lws =
            Api::<DynamicObject>::namespaced_with(client.clone(), ns, &render::lws_resource());
        let lws_name = render::lws_name(name);
        if lws.get_opt(&lws_name).await?.is_some() {
            delete_if_present(&lws, &lws_name).await?;
            let secrets = Api::<Secret>::namespaced(client.clone(), ns);
            delete_if_present(&secrets, &render::group_secret_name(name)).await?;
            let note = format!(
                "deleted LeaderWorkerSet {lws_name}: the Deployment serves all {desired} replica(s)"
            );
            publish(ctx, svc, EventType::Normal, "Switched", note).await;
        }
    }
    Ok(workload)
}

/// Applies the group Secret and the LeaderWorkerSet of an LLMService split into pipeline
/// stages, and removes the Deployment it had before once every group is ready.
async fn apply_groups(
    svc: &LLMService,
    ctx: &Context,
    ns: &str,
    name: &str,
    desired: i32,
) -> Result<WorkloadStatus, Error> {
    let client = &ctx.client;
    let apply = PatchParams::apply(FIELD_MANAGER).force();
    // The secret is made once; a rollout or a restarted group reads the same one.
    let secrets = Api::<Secret>::namespaced(client.clone(), ns);
    let secret_name = render::group_secret_name(name);
    if secrets.get_opt(&secret_name).await?.is_none() {
        let value = new_group_secret();
        secrets
            .create(&PostParams::default(), &render::group_secret(svc, &value)?)
            .await?;
    }
    let lws = Api::<DynamicObject>::namespaced_with(client.clone(), ns, &render::lws_resource());
    let lws_name = render::lws_name(name);
    let before = lws.get_opt(&lws_name).await?;
    let wanted = render::leaderworkerset(svc, &ctx.render, desired)?;
    let after = lws.patch(&lws_name, &apply, &Patch::Apply(&wanted)).await?;
    let template = |o: &DynamicObject| o.data["spec"]["leaderWorkerTemplate"].clone();
    announce(
        ctx,
        svc,
        "LeaderWorkerSet",
        &lws_name,
        &format!("group(s) of {} pods", render::pipeline_stages(svc)),
        before.as_ref().map(|b| {
            let replicas = b.data["spec"]["replicas"].as_i64().unwrap_or(1);
            let replicas = i32::try_from(replicas).unwrap_or(i32::MAX);
            (b.metadata.generation, template(b), replicas)
        }),
        (after.metadata.generation, template(&after)),
        desired,
    )
    .await;
    let workload = WorkloadStatus::of_leaderworkerset(&after);
    if workload.complete(desired) {
        let deployments = Api::<Deployment>::namespaced(client.clone(), ns);
        if deployments.get_opt(name).await?.is_some() {
            delete_if_present(&deployments, name).await?;
            let note = format!(
                "deleted Deployment {name}: LeaderWorkerSet {lws_name} serves all {desired} group(s)"
            );
            publish(ctx, svc, EventType::Normal, "Switched", note).await;
        }
    }
    Ok(workload)
}

/// 32 random bytes as hex: the secret a group's ranks admit each other with.
fn new_group_secret() -> String {
    use rand::Rng;
    let bytes: [u8; 32] = rand::rng().random();
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

async fn delete_if_present<K>(api: &Api<K>, name: &str) -> Result<(), Error>
where
    K: Clone + serde::de::DeserializeOwned + std::fmt::Debug,
{
    match api.delete(name, &DeleteParams::background()).await {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(s)) if s.code == 404 => Ok(()),
        Err(e) => Err(e.into()),
    }
}

/// Whether the cluster serves `leaderworkerset.x-k8s.io/v1` (discovery, which every
/// authenticated client may read).
pub async fn leaderworkerset_installed(client: &Client) -> Result<bool, Error> {
    let version = format!("{}/v1", render::LWS_GROUP);
    match client.list_api_group_resources(&version).await {
        Ok(list) => Ok(list.resources.iter().any(|r| r.name == "leaderworkersets")),
        Err(kube::Error::Api(s)) if s.code == 404 => Ok(false),
        Err(e) => Err(e.into()),
    }
}

/// Whether the cluster serves the InferencePool API (`inference.networking.k8s.io/v1`).
pub async fn inference_pools_installed(client: &Client) -> Result<bool, Error> {
    let version = format!("{}/v1", render::INFERENCE_GROUP);
    match client.list_api_group_resources(&version).await {
        Ok(list) => Ok(list.resources.iter().any(|r| r.name == "inferencepools")),
        Err(kube::Error::Api(s)) if s.code == 404 => Ok(false),
        Err(e) => Err(e.into()),
    }
}

/// Applies the LLMService's InferencePool when it wants one, deletes one it no longer wants;
/// where the API is not installed, an LLMService that asked for one itself gets a Warning
/// Event once per generation saying so.
async fn sync_inference_pool(
    svc: &LLMService,
    ctx: &Context,
    ns: &str,
    name: &str,
) -> Result<(), Error> {
    let wanted = render::wants_inference_pool(svc, &ctx.render);
    let installed = inference_pools_installed(&ctx.client).await?;
    if !installed {
        let asked = svc.spec.inference_pool.as_ref().and_then(|p| p.enabled) == Some(true);
        let observed = svc.status.as_ref().and_then(|s| s.observed_generation);
        if asked && observed != svc.metadata.generation {
            let note = format!(
                "spec.inferencePool.enabled is true, but this cluster serves no {}/v1 \
                 InferencePool API: install the Gateway API Inference Extension's CRDs for the \
                 pool to be made",
                render::INFERENCE_GROUP
            );
            publish(
                ctx,
                svc,
                EventType::Warning,
                "InferencePoolUnavailable",
                note,
            )
            .await;
        }
        return Ok(());
    }
    let pools = Api::<DynamicObject>::namespaced_with(
        ctx.client.clone(),
        ns,
        &render::inference_pool_resource(),
    );
    if wanted {
        let apply = PatchParams::apply(FIELD_MANAGER).force();
        pools
            .patch(name, &apply, &Patch::Apply(&render::inference_pool(svc)?))
            .await?;
        return Ok(());
    }
    match pools.delete(name, &DeleteParams::default()).await {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(s)) if s.code == 404 => Ok(()),
        Err(e) => Err(e.into()),
    }
}

/// The message of `Ready=False` with reason `LeaderWorkerSetMissing`.
fn lws_missing_message(svc: &LLMService) -> String {
    format!(
        "spec.engine.pipelineParallelSize is {}, so each replica is a LeaderWorkerSet group of \
         {} pods, but this cluster serves no {}/v1 API. Install LeaderWorkerSet (see \
         https://lws.sigs.k8s.io/docs/installation/, e.g. kubectl apply --server-side -f \
         https://github.com/kubernetes-sigs/lws/releases/download/v0.9.0/manifests.yaml); this \
         LLMService is picked up again within a minute",
        render::pipeline_stages(svc),
        render::pipeline_stages(svc),
        render::LWS_GROUP
    )
}

/// An LLMService that needs LeaderWorkerSet in a cluster without it: `Ready=False`, reason
/// `LeaderWorkerSetMissing`, and a retry every 30 s; whatever serves it now is left alone.
async fn lws_missing(
    svc: &LLMService,
    ctx: &Context,
    llms: &Api<LLMService>,
    name: &str,
) -> Result<Action, Error> {
    let message = lws_missing_message(svc);
    let mut st = status::compute(
        svc,
        desired_replicas(svc),
        &Observed::default(),
        Timestamp::now(),
    );
    st.phase = Some("Failed".into());
    if let Some(c) = st.conditions.iter_mut().find(|c| c.type_ == "Ready") {
        c.reason = "LeaderWorkerSetMissing".into();
        c.message = message.clone();
    }
    if svc.status.as_ref().map(status::comparable) != Some(status::comparable(&st)) {
        publish(
            ctx,
            svc,
            EventType::Warning,
            "LeaderWorkerSetMissing",
            message,
        )
        .await;
        write_status(llms, name, &st).await?;
    }
    Ok(Action::requeue(Duration::from_secs(30)))
}
