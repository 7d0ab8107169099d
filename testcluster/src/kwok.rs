//! kwok's configuration: the stages that make fake nodes Ready and scheduled pods Running and
//! Ready the way a kubelet would, and the fake nodes themselves.

use k8s_openapi::api::core::v1::Node;
use serde_json::json;

/// Annotation that tells kwok to manage a node.
pub const NODE_ANNOTATION: &str = "kwok.x-k8s.io/node";

/// kwok's configuration file: stages for nodes and pods.
///
/// - `node-initialize`: a node that is not Ready gets Ready conditions, addresses and a large
///   allocatable (CPU, memory, pods and 64 `nvidia.com/gpu`, so GPU manifests schedule too).
/// - `pod-ready`: a scheduled pending pod gets every container running and ready, init
///   containers completed, an IP from kwok's pool, and phase Running.
/// - `pod-delete`: a pod marked for deletion is removed, as a kubelet confirms termination.
pub const STAGES: &str = r#"apiVersion: config.kwok.x-k8s.io/v1alpha1
kind: KwokConfiguration
options:
  nodeLeaseParallelism: 4
  nodePlayStageParallelism: 4
  podPlayStageParallelism: 8
  podsOnNodeSyncParallelism: 4
---
apiVersion: kwok.x-k8s.io/v1alpha1
kind: Stage
metadata:
  name: node-initialize
spec:
  resourceRef: {apiGroup: v1, kind: Node}
  selector:
    matchExpressions:
    - key: '.status.conditions.[] | select( .type == "Ready" ) | .status'
      operator: NotIn
      values: ["True"]
  next:
    statusTemplate: |
      {{ $now := Now }}
      conditions:
      {{ range NodeConditions }}
      - lastHeartbeatTime: {{ $now | Quote }}
        lastTransitionTime: {{ $now | Quote }}
        message: {{ .message | Quote }}
        reason: {{ .reason | Quote }}
        status: {{ .status | Quote }}
        type: {{ .type | Quote }}
      {{ end }}
      addresses:
      - address: {{ NodeIP | Quote }}
        type: InternalIP
      - address: {{ NodeName | Quote }}
        type: Hostname
      allocatable: &capacity
        cpu: "1000"
        memory: 1Ti
        pods: "1000"
        nvidia.com/gpu: "64"
      capacity: *capacity
      nodeInfo:
        architecture: amd64
        operatingSystem: linux
        kubeletVersion: fake
        containerRuntimeVersion: kwok
      phase: Running
---
apiVersion: kwok.x-k8s.io/v1alpha1
kind: Stage
metadata:
  name: pod-ready
spec:
  resourceRef: {apiGroup: v1, kind: Pod}
  selector:
    matchExpressions:
    - key: .metadata.deletionTimestamp
      operator: DoesNotExist
    - key: .status.phase
      operator: In
      values: [Pending]
  next:
    statusTemplate: |
      {{ $now := Now }}
      conditions:
      - {lastTransitionTime: {{ $now | Quote }}, status: "True", type: Initialized}
      - {lastTransitionTime: {{ $now | Quote }}, status: "True", type: PodScheduled}
      - {lastTransitionTime: {{ $now | Quote }}, status: "True", type: ContainersReady}
      - {lastTransitionTime: {{ $now | Quote }}, status: "True", type: Ready}
      containerStatuses:
      {{ range .spec.containers }}
      - image: {{ .image | Quote }}
        name: {{ .name | Quote }}
        ready: true
        started: true
        restartCount: 0
        state: {running: {startedAt: {{ $now | Quote }}}}
      {{ end }}
      initContainerStatuses:
      {{ range .spec.initContainers }}
      - image: {{ .image | Quote }}
        name: {{ .name | Quote }}
        ready: true
        restartCount: 0
        state: {terminated: {exitCode: 0, reason: Completed, startedAt: {{ $now | Quote }}, finishedAt: {{ $now | Quote }}}}
      {{ end }}
      hostIP: {{ NodeIPWith .spec.nodeName | Quote }}
      podIP: {{ PodIPWith .spec.nodeName ( or .spec.hostNetwork false ) ( or .metadata.uid "" ) ( or .metadata.name "" ) ( or .metadata.namespace "" ) | Quote }}
      phase: Running
      startTime: {{ $now | Quote }}
---
apiVersion: kwok.x-k8s.io/v1alpha1
kind: Stage
metadata:
  name: pod-delete
spec:
  resourceRef: {apiGroup: v1, kind: Pod}
  selector:
    matchExpressions:
    - key: .metadata.deletionTimestamp
      operator: Exists
  next:
    delete: true
"#;

/// A fake node that kwok manages (labelled `type: kwok`, no taints, so every pod may land there).
pub fn fake_node(name: &str) -> Result<Node, serde_json::Error> {
    serde_json::from_value(json!({
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "annotations": { NODE_ANNOTATION: "fake" },
            "labels": {
                "type": "kwok",
                "kubernetes.io/hostname": name,
                "kubernetes.io/os": "linux",
                "kubernetes.io/arch": "amd64",
            },
        },
    }))
}
