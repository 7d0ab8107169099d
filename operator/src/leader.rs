//! Leader election through a `coordination.k8s.io` Lease, so that of several operator replicas
//! exactly one reconciles. The holder renews the lease every third of its duration; another
//! replica takes it over only after it has gone unrenewed for a whole duration. Updates use the
//! lease's resourceVersion, so two candidates can never both win the same round.

use std::time::Duration;

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use k8s_openapi::jiff::{SignedDuration, Timestamp};
use kube::api::{Api, PostParams};
use kube::Client;

use crate::Error;

/// One candidate's handle on the lease.
#[derive(Clone)]
pub struct LeaseLock {
    api: Api<Lease>,
    name: String,
    identity: String,
    duration: Duration,
}

fn is_conflict(e: &kube::Error) -> bool {
    matches!(e, kube::Error::Api(s) if s.code == 409)
}

impl LeaseLock {
    /// A candidate `identity` for the lease `namespace/name` held for `duration` per renewal.
    pub fn new(
        client: Client,
        namespace: &str,
        name: &str,
        identity: &str,
        duration: Duration,
    ) -> Self {
        Self {
            api: Api::namespaced(client, namespace),
            name: name.to_string(),
            identity: identity.to_string(),
            duration,
        }
    }

    /// This candidate's identity.
    pub fn identity(&self) -> &str {
        &self.identity
    }

    /// How often the holder renews.
    pub fn renew_interval(&self) -> Duration {
        self.duration / 3
    }

    /// Takes the lease if it is free or expired, renews it if held; returns whether this
    /// candidate holds it now.
    pub async fn try_acquire_or_renew(&self) -> Result<bool, Error> {
        let now = Timestamp::now();
        let secs = i32::try_from(self.duration.as_secs().max(1)).unwrap_or(i32::MAX);
        let Some(mut lease) = self.api.get_opt(&self.name).await? else {
            let lease = Lease {
                metadata: ObjectMeta {
                    name: Some(self.name.clone()),
                    ..Default::default()
                },
                spec: Some(LeaseSpec {
                    holder_identity: Some(self.identity.clone()),
                    lease_duration_seconds: Some(secs),
                    acquire_time: Some(MicroTime(now)),
                    renew_time: Some(MicroTime(now)),
                    lease_transitions: Some(0),
                    ..Default::default()
                }),
            };
            return match self.api.create(&PostParams::default(), &lease).await {
                Ok(_) => Ok(true),
                Err(e) if is_conflict(&e) => Ok(false),
                Err(e) => Err(e.into()),
            };
        };
        let spec = lease.spec.get_or_insert_with(Default::default);
        let holder = spec.holder_identity.clone().unwrap_or_default();
        if holder != self.identity {
            let held_for =
                SignedDuration::from_secs(i64::from(spec.lease_duration_seconds.unwrap_or(secs)));
            let expired = match &spec.renew_time {
                Some(MicroTime(t)) => t.checked_add(held_for).map_or(true, |end| end < now),
                None => true,
            };
            if !holder.is_empty() && !expired {
                return Ok(false);
            }
            spec.holder_identity = Some(self.identity.clone());
            spec.acquire_time = Some(MicroTime(now));
            spec.lease_transitions = Some(spec.lease_transitions.unwrap_or(0) + 1);
        }
        spec.renew_time = Some(MicroTime(now));
        spec.lease_duration_seconds = Some(secs);
        match self
            .api
            .replace(&self.name, &PostParams::default(), &lease)
            .await
        {
            Ok(_) => Ok(true),
            Err(e) if is_conflict(&e) => Ok(false),
            Err(e) => Err(e.into()),
        }
    }

    /// Waits until this candidate holds the lease.
    pub async fn acquire(&self) -> Result<(), Error> {
        loop {
            match self.try_acquire_or_renew().await {
                Ok(true) => return Ok(()),
                Ok(false) => {}
                Err(e) => tracing::warn!(error = %e, "leader election: could not read the lease"),
            }
            tokio::time::sleep(self.renew_interval()).await;
        }
    }

    /// Renews the lease until a renewal fails for longer than the lease duration (another
    /// replica may then take over); returns that error. Never returns while leadership holds.
    pub async fn keep(&self) -> Error {
        let mut last_ok = tokio::time::Instant::now();
        loop {
            tokio::time::sleep(self.renew_interval()).await;
            match self.try_acquire_or_renew().await {
                Ok(true) => last_ok = tokio::time::Instant::now(),
                Ok(false) => {
                    return Error::Leader(format!("lease {} taken by another replica", self.name))
                }
                Err(e) if last_ok.elapsed() > self.duration => {
                    return Error::Leader(format!("could not renew lease {}: {e}", self.name))
                }
                Err(e) => tracing::warn!(error = %e, "leader election: renewal failed, retrying"),
            }
        }
    }

    /// Gives the lease up (on graceful shutdown) so a standby replica takes over at once.
    pub async fn release(&self) {
        if let Ok(Some(mut lease)) = self.api.get_opt(&self.name).await {
            if let Some(spec) = lease.spec.as_mut() {
                if spec.holder_identity.as_deref() == Some(&self.identity) {
                    spec.holder_identity = None;
                    spec.renew_time = None;
                    let _ = self
                        .api
                        .replace(&self.name, &PostParams::default(), &lease)
                        .await;
                }
            }
        }
    }
}
