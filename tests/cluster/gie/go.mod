// Pins the Gateway API Inference Extension whose InferencePool CRD the cluster tests install
// (scripts/fetch-gie-crds.sh copies it from the module into ~/.cache/ferrite/k8s/).
module ferrite.dev/tests/cluster/gie

go 1.26

require sigs.k8s.io/gateway-api-inference-extension v1.6.0
