//! A real Kubernetes control plane on loopback for Ferrite's tests — the envtest approach.
//!
//! [`TestCluster::start`] runs etcd, kube-apiserver, kube-controller-manager, kube-scheduler,
//! kwok (fake nodes that make scheduled pods Running and Ready) and LeaderWorkerSet's
//! controller with its webhooks ([`lws`]) on free loopback ports with freshly generated
//! certificates, waits until the API server's `/readyz` answers, a fake node is Ready and
//! LWS's webhooks answer, and writes a kubeconfig. Dropping the cluster stops every process and deletes
//! its data; a supervisor per process stops it too when the test process dies without dropping
//! (see [`process`]). The binaries come from `scripts/build-k8s.sh`, which builds them from the
//! Go module proxy into `~/.cache/ferrite/k8s/<version>/` the first time.
//!
//! ```no_run
//! # async fn demo() -> Result<(), ferrite_testcluster::Error> {
//! let cluster = ferrite_testcluster::TestCluster::shared();
//! let client = cluster.client().await?;
//! let ns = cluster.namespace(&client, "demo").await?;
//! # Ok(()) }
//! ```

#![forbid(unsafe_code)]

pub mod apply;
pub mod certs;
pub mod kwok;
pub mod lws;
pub mod process;

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::{Namespace, Node, ServiceAccount};
use kube::api::{Api, PostParams};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::Client;

pub use apply::apply;
use process::Supervised;

/// Everything that can go wrong while starting or using a test cluster.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A file could not be read or written.
    #[error("{path}: {source}")]
    Io {
        /// The file or folder.
        path: PathBuf,
        /// The underlying error.
        source: std::io::Error,
    },
    /// The control-plane binaries could not be found or built.
    #[error("control-plane binaries: {0}")]
    Binaries(String),
    /// Key or certificate generation failed.
    #[error("certificates: {0}")]
    Certificates(String),
    /// A process could not be started.
    #[error("cannot start {name}: {source}")]
    Spawn {
        /// Which process.
        name: String,
        /// The underlying error.
        source: std::io::Error,
    },
    /// A process exited or did not become ready in time; carries the end of its log.
    #[error("{name} did not become ready: {reason}\n--- last lines of its log ---\n{log}")]
    NotReady {
        /// Which process.
        name: String,
        /// What was waited for.
        reason: String,
        /// The end of the process's log.
        log: String,
    },
    /// A Kubernetes API call failed.
    #[error("kubernetes API: {0}")]
    Kube(#[from] kube::Error),
    /// The kubeconfig could not be loaded.
    #[error("kubeconfig: {0}")]
    Kubeconfig(#[from] kube::config::KubeconfigError),
    /// An object could not be built.
    #[error("json: {0}")]
    Json(#[from] serde_json::Error),
}

impl Error {
    /// An I/O error on `path`.
    pub fn io(path: &Path, source: std::io::Error) -> Self {
        Self::Io {
            path: path.to_path_buf(),
            source,
        }
    }
}

/// Which parts of the control plane to run.
#[derive(Debug, Clone)]
pub struct Options {
    /// Run kube-controller-manager (ReplicaSets, garbage collection, service accounts, ...).
    pub controller_manager: bool,
    /// Run kube-scheduler (binds pods to nodes).
    pub scheduler: bool,
    /// Run kwok and create fake nodes that make scheduled pods Running and Ready.
    pub kwok: bool,
    /// Number of fake nodes.
    pub nodes: usize,
    /// Pod CIDR of the fake nodes; kwok gives pods IPs from it.
    pub pod_cidr: String,
    /// Run LeaderWorkerSet's controller and webhooks, with its CRDs installed (needs the
    /// controller-manager, whose StatefulSet controller creates the groups' pods).
    pub leaderworkerset: bool,
}

impl Default for Options {
    fn default() -> Self {
        Self {
            controller_manager: true,
            scheduler: true,
            kwok: true,
            nodes: 1,
            pod_cidr: "10.244.0.0/16".to_string(),
            leaderworkerset: true,
        }
    }
}

/// A running control plane. Dropping it stops every process and deletes its data folder.
#[derive(Debug)]
pub struct TestCluster {
    dir: PathBuf,
    kubeconfig: PathBuf,
    server: String,
    options: Options,
    // Stopped in reverse start order on drop.
    processes: Vec<Supervised>,
}

/// Where LeaderWorkerSet's controller's two ports (webhooks, health probes) come from.
type PortSource = Box<dyn FnMut() -> Result<[u16; 2], Error>>;

/// Starts of LeaderWorkerSet's controller before a port taken under it is an error.
const LWS_STARTS: usize = 3;

/// Two port numbers the OS says are free now.
fn two_free_ports() -> Result<[u16; 2], Error> {
    match free_ports(2)?[..] {
        [a, b] => Ok([a, b]),
        _ => Err(Error::Binaries("could not pick free ports".into())),
    }
}

/// Port numbers the OS says are free now (held together so they are distinct).
fn free_ports(n: usize) -> Result<Vec<u16>, Error> {
    let listeners = (0..n)
        .map(|_| TcpListener::bind("127.0.0.1:0"))
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| Error::io(Path::new("127.0.0.1:0"), e))?;
    listeners
        .iter()
        .map(|l| l.local_addr().map(|a| a.port()))
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| Error::io(Path::new("127.0.0.1:0"), e))
}

/// The folder holding the control-plane binaries: `$FERRITE_K8S_DIR` when set, otherwise the
/// one `scripts/build-k8s.sh` prints — building them first when the cache lacks them.
pub fn binaries_dir() -> Result<PathBuf, Error> {
    cached_dir("FERRITE_K8S_DIR", "build-k8s.sh")
}

/// The Gateway API Inference Extension's InferencePool CRD: in `$FERRITE_GIE_DIR` when set,
/// otherwise in the folder `scripts/fetch-gie-crds.sh` prints — fetching it first when missing.
pub fn inference_pool_crd() -> Result<PathBuf, Error> {
    Ok(cached_dir("FERRITE_GIE_DIR", "fetch-gie-crds.sh")?.join("inferencepools.yaml"))
}

/// The folder holding `prometheus` and `promtool`: `$FERRITE_PROMETHEUS_DIR` when set,
/// otherwise the one `scripts/build-prometheus.sh` prints — building them first when missing.
pub fn prometheus_dir() -> Result<PathBuf, Error> {
    cached_dir("FERRITE_PROMETHEUS_DIR", "build-prometheus.sh")
}

/// `$<var>` when set, otherwise the folder `scripts/<script> --print-dir` prints (the script
/// builds what the folder should hold first when the cache lacks it).
pub(crate) fn cached_dir(var: &str, script: &str) -> Result<PathBuf, Error> {
    if let Some(dir) = std::env::var_os(var) {
        return Ok(PathBuf::from(dir));
    }
    let script = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../scripts")
        .join(script);
    let out = std::process::Command::new("bash")
        .arg(&script)
        .arg("--print-dir")
        .stderr(std::process::Stdio::inherit())
        .output()
        .map_err(|e| Error::io(&script, e))?;
    if !out.status.success() {
        return Err(Error::Binaries(format!(
            "{} failed ({})",
            script.display(),
            out.status
        )));
    }
    Ok(PathBuf::from(String::from_utf8_lossy(&out.stdout).trim()))
}

fn binary(dir: &Path, name: &str) -> Result<PathBuf, Error> {
    let path = dir.join(name);
    if path.is_file() {
        Ok(path)
    } else {
        Err(Error::Binaries(format!(
            "{} is missing; run scripts/build-k8s.sh",
            path.display()
        )))
    }
}

fn kubeconfig_yaml(server: &str, certs: &certs::CertFiles) -> String {
    format!(
        "apiVersion: v1
kind: Config
clusters:
- name: ferrite-test
  cluster:
    server: {server}
    certificate-authority: {ca}
users:
- name: ferrite-admin
  user:
    client-certificate: {cert}
    client-key: {key}
contexts:
- name: ferrite-test
  context: {{cluster: ferrite-test, user: ferrite-admin, namespace: default}}
current-context: ferrite-test
",
        ca = certs.ca_cert.display(),
        cert = certs.admin_cert.display(),
        key = certs.admin_key.display(),
    )
}

fn args(list: &[&str]) -> Vec<String> {
    list.iter().map(|s| s.to_string()).collect()
}

impl TestCluster {
    /// Starts a control plane with default [`Options`] and waits until it is ready.
    pub fn start() -> Result<Self, Error> {
        Self::start_with(Options::default())
    }

    /// Starts a control plane and waits until it is ready (blocking; safe to call from async
    /// code, the waiting runs on its own thread).
    pub fn start_with(options: Options) -> Result<Self, Error> {
        Self::start_with_ports(options, Box::new(two_free_ports))
    }

    /// [`TestCluster::start_with`], taking LeaderWorkerSet's controller's ports from
    /// `lws_ports`.
    fn start_with_ports(options: Options, lws_ports: PortSource) -> Result<Self, Error> {
        let bins = binaries_dir()?;
        let dir = tempfile::Builder::new()
            .prefix("ferrite-testcluster-")
            .tempdir()
            .map_err(|e| Error::io(&std::env::temp_dir(), e))?
            .keep();
        let mut cluster = Self {
            kubeconfig: dir.join("kubeconfig"),
            dir,
            server: String::new(),
            options,
            processes: Vec::new(),
        };
        // On error, `cluster` drops here and stops whatever was started.
        cluster.launch(&bins, lws_ports)?;
        Ok(cluster)
    }

    fn spawn(&mut self, name: &str, program: &Path, args: Vec<String>) -> Result<(), Error> {
        let log = self.dir.join(format!("{name}.log"));
        // etcd starts first and stops last: its supervisor removes the data folder.
        let cleanup = self.processes.is_empty().then_some(self.dir.as_path());
        let p = Supervised::spawn(name, program, &args, &log, cleanup)?;
        self.processes.push(p);
        Ok(())
    }

    fn launch(&mut self, bins: &Path, lws_ports: PortSource) -> Result<(), Error> {
        let d = self.dir.display().to_string();
        let certs = certs::generate(&self.dir)?;
        let [etcd_client, etcd_peer, api_port, kwok_port] = free_ports(4)?[..] else {
            return Err(Error::Binaries("could not pick free ports".into()));
        };

        let etcd_url = format!("http://127.0.0.1:{etcd_client}");
        let peer_url = format!("http://127.0.0.1:{etcd_peer}");
        let mut etcd_args = args(&["--name=default", "--unsafe-no-fsync", "--log-level=warn"]);
        etcd_args.extend([
            format!("--data-dir={d}/etcd"),
            format!("--listen-client-urls={etcd_url}"),
            format!("--advertise-client-urls={etcd_url}"),
            format!("--listen-peer-urls={peer_url}"),
            format!("--initial-advertise-peer-urls={peer_url}"),
            format!("--initial-cluster=default={peer_url}"),
        ]);
        self.spawn("etcd", &binary(bins, "etcd")?, etcd_args)?;

        self.server = format!("https://127.0.0.1:{api_port}");
        let mut api_args = args(&[
            "--bind-address=127.0.0.1",
            "--advertise-address=127.0.0.1",
            // The default reconciler refuses a loopback address for the kubernetes Service.
            "--endpoint-reconciler-type=none",
            "--service-cluster-ip-range=10.0.0.0/24",
            "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
            "--authorization-mode=RBAC",
            "--allow-privileged=true",
            "--enable-priority-and-fairness=false",
            "--v=1",
        ]);
        api_args.extend([
            format!("--etcd-servers={etcd_url}"),
            format!("--secure-port={api_port}"),
            format!("--cert-dir={d}/apiserver-certs"),
            format!("--tls-cert-file={}", certs.server_cert.display()),
            format!("--tls-private-key-file={}", certs.server_key.display()),
            format!("--client-ca-file={}", certs.ca_cert.display()),
            format!("--service-account-key-file={}", certs.sa_pub.display()),
            format!(
                "--service-account-signing-key-file={}",
                certs.sa_key.display()
            ),
        ]);
        self.spawn("kube-apiserver", &binary(bins, "kube-apiserver")?, api_args)?;

        std::fs::write(&self.kubeconfig, kubeconfig_yaml(&self.server, &certs))
            .map_err(|e| Error::io(&self.kubeconfig, e))?;
        let kc = self.kubeconfig.display().to_string();

        // Wait for the API server before the clients start, so their logs stay quiet.
        self.wait(
            "kube-apiserver",
            Duration::from_secs(120),
            "/readyz to answer ok",
            |c| async move { readyz(&c).await },
        )?;

        if self.options.controller_manager {
            let mut cm_args = args(&["--leader-elect=false", "--secure-port=0", "--v=1"]);
            cm_args.extend([
                format!("--kubeconfig={kc}"),
                format!(
                    "--service-account-private-key-file={}",
                    certs.sa_key.display()
                ),
                format!("--root-ca-file={}", certs.ca_cert.display()),
                format!("--cluster-signing-cert-file={}", certs.ca_cert.display()),
                format!("--cluster-signing-key-file={}", certs.ca_key.display()),
            ]);
            let cm = binary(bins, "kube-controller-manager")?;
            self.spawn("kube-controller-manager", &cm, cm_args)?;
        }
        if self.options.scheduler {
            let mut s_args = args(&["--leader-elect=false", "--secure-port=0", "--v=1"]);
            s_args.push(format!("--kubeconfig={kc}"));
            self.spawn("kube-scheduler", &binary(bins, "kube-scheduler")?, s_args)?;
        }
        if self.options.kwok {
            let config = self.dir.join("kwok.yaml");
            std::fs::write(&config, kwok::STAGES).map_err(|e| Error::io(&config, e))?;
            let mut k_args = args(&[
                "--manage-all-nodes=false",
                "--node-lease-duration-seconds=40",
                "--node-ip=10.255.0.1",
            ]);
            k_args.extend([
                format!(
                    "--manage-nodes-with-annotation-selector={}=fake",
                    kwok::NODE_ANNOTATION
                ),
                format!("--kubeconfig={kc}"),
                format!("--config={}", config.display()),
                format!("--cidr={}", self.options.pod_cidr),
                format!("--server-address=127.0.0.1:{kwok_port}"),
            ]);
            self.spawn("kwok", &binary(bins, "kwok")?, k_args)?;
            let (nodes, cidr) = (self.options.nodes, self.options.pod_cidr.as_str());
            self.wait(
                "kwok",
                Duration::from_secs(60),
                "fake nodes to become Ready",
                |c| async move { fake_nodes_ready(&c, nodes, cidr).await },
            )?;
        }
        if self.options.leaderworkerset && self.options.controller_manager {
            self.launch_lws(&kc, &certs, lws_ports)?;
        }
        Ok(())
    }

    /// Installs LeaderWorkerSet's CRDs and starts its controller, its webhooks registered,
    /// on ports from `ports`, picked just before it starts. A port picked free can still be
    /// taken before the controller binds it (by another test's cluster, or as the local port
    /// of some outgoing connection); the controller then exits with "address already in
    /// use" and is started again on other ports, up to [`LWS_STARTS`] times in all.
    fn launch_lws(
        &mut self,
        kc: &str,
        certs: &certs::CertFiles,
        mut ports: PortSource,
    ) -> Result<(), Error> {
        let lws_dir = lws::binaries_dir()?;
        let crds = lws_dir.join("crds.yaml");
        self.block_on(|c| async move { install_crds(&c, &crds).await })?;
        let ca = std::fs::read(&certs.ca_cert).map_err(|e| Error::io(&certs.ca_cert, e))?;
        let log = self.dir.join("lws-controller.log");
        let mut start = 1;
        loop {
            let [hook_port, health_port] = ports()?;
            let ca = ca.clone();
            self.block_on(|c| async move { lws::register_webhooks(&c, hook_port, &ca).await })?;
            let config = self.dir.join("lws.yaml");
            let text = lws::config(hook_port, health_port, &certs.webhook_dir);
            std::fs::write(&config, text).map_err(|e| Error::io(&config, e))?;
            let l_args = vec![
                format!("--config={}", config.display()),
                format!("--kubeconfig={kc}"),
                "--zap-log-level=info".to_string(),
            ];
            self.spawn(
                "lws-controller",
                &binary(&lws_dir, "lws-controller")?,
                l_args,
            )?;
            match self.wait(
                "lws-controller",
                Duration::from_secs(60),
                "LeaderWorkerSet's webhooks to answer",
                |c| async move { lws::webhooks_answer(&c).await },
            ) {
                Err(Error::NotReady {
                    name, log: tail, ..
                }) if name == "lws-controller"
                    && start < LWS_STARTS
                    && tail.contains("address already in use") =>
                {
                    // The controller exited (its supervisor is done): forget it, and keep its
                    // log apart, so the next start's log says only what that start did.
                    self.processes.pop();
                    let kept = self.dir.join(format!("lws-controller.start{start}.log"));
                    std::fs::rename(&log, &kept).map_err(|e| Error::io(&log, e))?;
                    start += 1;
                }
                result => return result,
            }
        }
    }

    /// Runs `f` with an admin client to completion on a runtime of its own thread (blocking;
    /// safe to call from async code, like [`TestCluster::wait`]).
    fn block_on<F, Fut, T>(&self, f: F) -> Result<T, Error>
    where
        F: FnOnce(Client) -> Fut + Send,
        Fut: std::future::Future<Output = Result<T, Error>>,
        T: Send,
    {
        let kubeconfig = self.kubeconfig.clone();
        on_own_thread("a setup step", || async move {
            f(client_from(&kubeconfig).await?).await
        })
    }

    /// Polls `check` until it returns `Ok(true)`, failing early when a process has exited.
    /// Blocking; the polling runs on its own thread with one runtime and one client, so this is
    /// safe to call from async code.
    fn wait<F, Fut>(&self, name: &str, timeout: Duration, what: &str, check: F) -> Result<(), Error>
    where
        F: Fn(Client) -> Fut + Sync,
        Fut: std::future::Future<Output = Result<bool, Error>>,
    {
        // Built on the polling thread, so neither `check` nor its futures need to be `Send`.
        let poll = || async {
            let client = client_from(&self.kubeconfig).await?;
            let deadline = Instant::now() + timeout;
            loop {
                if let Some(dead) = self.processes.iter().find(|p| !p.is_running()) {
                    return Err(Error::NotReady {
                        name: dead.name().to_string(),
                        reason: format!("it exited while waiting for {what}"),
                        log: dead.log_tail(4000),
                    });
                }
                let last = match check(client.clone()).await {
                    Ok(true) => return Ok(()),
                    Ok(false) => "not yet".to_string(),
                    Err(e) => e.to_string(),
                };
                if Instant::now() > deadline {
                    return Err(Error::NotReady {
                        name: name.to_string(),
                        reason: format!("timed out after {timeout:?} waiting for {what}: {last}"),
                        log: self.log_tail(name, 4000),
                    });
                }
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        };
        on_own_thread("the readiness check", poll)
    }

    /// One cluster shared by all tests of a test binary, started on first use. Each test should
    /// work in its own namespace ([`TestCluster::namespace`]). The processes stop when the test
    /// binary exits (their supervisors see the pipe close).
    ///
    /// # Panics
    /// When the cluster cannot start, with the reason and the failing process's log.
    pub fn shared() -> &'static TestCluster {
        static SHARED: OnceLock<TestCluster> = OnceLock::new();
        SHARED.get_or_init(|| match Self::start() {
            Ok(c) => c,
            Err(e) => panic!("the test control plane did not start: {e}"),
        })
    }

    /// Path of an admin kubeconfig for this cluster.
    pub fn kubeconfig_path(&self) -> &Path {
        &self.kubeconfig
    }

    /// The API server's URL (`https://127.0.0.1:<port>`).
    pub fn server(&self) -> &str {
        &self.server
    }

    /// The cluster's data folder (certificates, etcd data, logs, kubeconfig).
    pub fn data_dir(&self) -> &Path {
        &self.dir
    }

    /// The running processes, as (name, pid).
    pub fn processes(&self) -> Vec<(String, u32)> {
        self.processes
            .iter()
            .map(|p| (p.name().to_string(), p.pid()))
            .collect()
    }

    /// The end of one process's log (`kube-apiserver`, `kwok`, ...), for diagnosing a test.
    pub fn log_tail(&self, name: &str, max: usize) -> String {
        process::log_tail(&self.dir.join(format!("{name}.log")), max)
    }

    /// A new admin client for this cluster, bound to the calling tokio runtime.
    pub async fn client(&self) -> Result<Client, Error> {
        client_from(&self.kubeconfig).await
    }

    /// Creates a fresh namespace named `<prefix>-<n>` and, when the controller-manager runs,
    /// waits for its `default` ServiceAccount so pods can be created in it at once.
    pub async fn namespace(&self, client: &Client, prefix: &str) -> Result<String, Error> {
        static COUNTER: AtomicU32 = AtomicU32::new(0);
        let n = COUNTER.fetch_add(1, Ordering::Relaxed);
        let name = format!("{prefix}-{}-{n}", std::process::id());
        let ns: Namespace =
            serde_json::from_value(serde_json::json!({"metadata": {"name": name}}))?;
        Api::<Namespace>::all(client.clone())
            .create(&PostParams::default(), &ns)
            .await?;
        if self.options.controller_manager {
            let sas = Api::<ServiceAccount>::namespaced(client.clone(), &name);
            let deadline = Instant::now() + Duration::from_secs(60);
            while sas.get_opt("default").await?.is_none() {
                if Instant::now() > deadline {
                    return Err(Error::NotReady {
                        name: "kube-controller-manager".into(),
                        reason: format!("no default ServiceAccount in {name} after 60 s"),
                        log: self.log_tail("kube-controller-manager", 4000),
                    });
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
        Ok(name)
    }

    /// Stops every process (reverse start order) and deletes the data folder.
    pub fn stop(&mut self) {
        while let Some(mut p) = self.processes.pop() {
            p.stop();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

impl Drop for TestCluster {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Runs the future `make` builds to completion on a runtime of a thread of its own (so the
/// caller may be async, and the future need not be `Send`), blocking until it is done.
fn on_own_thread<T, F, Fut>(what: &str, make: F) -> Result<T, Error>
where
    T: Send,
    F: FnOnce() -> Fut + Send,
    Fut: std::future::Future<Output = Result<T, Error>>,
{
    std::thread::scope(|s| {
        s.spawn(|| {
            tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .map_err(|e| Error::io(Path::new("tokio runtime"), e))?
                .block_on(make())
        })
        .join()
        .unwrap_or_else(|_| Err(Error::Binaries(format!("{what} panicked"))))
    })
}

/// A kube client from a kubeconfig file.
pub async fn client_from(kubeconfig: &Path) -> Result<Client, Error> {
    Ok(Client::try_from(config_from(kubeconfig).await?)?)
}

/// The client configuration a kubeconfig file describes.
async fn config_from(kubeconfig: &Path) -> Result<kube::Config, Error> {
    let kc = Kubeconfig::read_from(kubeconfig)?;
    Ok(kube::Config::from_custom_kubeconfig(kc, &KubeConfigOptions::default()).await?)
}

/// Creates the namespace `name` unless it exists (for manifests that name their namespace;
/// tests otherwise use [`TestCluster::namespace`]'s fresh ones).
pub async fn ensure_namespace(client: &Client, name: &str) -> Result<(), Error> {
    let ns: Namespace = serde_json::from_value(serde_json::json!({"metadata": {"name": name}}))?;
    match Api::<Namespace>::all(client.clone())
        .create(&PostParams::default(), &ns)
        .await
    {
        Err(kube::Error::Api(s)) if s.code == 409 => Ok(()),
        r => r.map(|_| ()).map_err(Error::from),
    }
}

async fn readyz(client: &Client) -> Result<bool, Error> {
    let req = http::Request::get("/readyz")
        .body(Vec::new())
        .map_err(|e| Error::Binaries(format!("building /readyz request: {e}")))?;
    Ok(client.request_text(req).await?.trim() == "ok")
}

async fn fake_nodes_ready(client: &Client, nodes: usize, cidr: &str) -> Result<bool, Error> {
    let api = Api::<Node>::all(client.clone());
    let mut ready = 0;
    for i in 0..nodes {
        let name = format!("kwok-node-{i}");
        let node = match api.get_opt(&name).await? {
            Some(n) => n,
            None => {
                let mut node = kwok::fake_node(&name)?;
                node.spec = Some(k8s_openapi::api::core::v1::NodeSpec {
                    pod_cidr: Some(cidr.to_string()),
                    ..Default::default()
                });
                api.create(&PostParams::default(), &node).await?
            }
        };
        let is_ready = node
            .status
            .and_then(|s| s.conditions)
            .is_some_and(|cs| cs.iter().any(|c| c.type_ == "Ready" && c.status == "True"));
        ready += usize::from(is_ready);
    }
    Ok(ready == nodes)
}

/// Installs (server-side applies) every CustomResourceDefinition in a YAML file and waits until
/// each is Established, so objects of its kinds can be created at once. Returns their names.
pub async fn install_crds(client: &Client, path: &Path) -> Result<Vec<String>, Error> {
    use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
    use kube::api::{Patch, PatchParams};

    let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
    let api = Api::<CustomResourceDefinition>::all(client.clone());
    let mut names = Vec::new();
    for doc in text
        .split("\n---")
        .filter(|d| d.lines().any(|l| l.starts_with("kind:")))
    {
        let crd: CustomResourceDefinition = serde_yaml::from_str(doc)
            .map_err(|e| Error::Binaries(format!("{}: not a CRD: {e}", path.display())))?;
        let name = crd.metadata.name.clone().unwrap_or_default();
        let pp = PatchParams::apply("ferrite-testcluster").force();
        api.patch(&name, &pp, &Patch::Apply(&crd)).await?;
        names.push(name);
    }
    for name in &names {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let crd = api.get(name).await?;
            let established = crd.status.and_then(|s| s.conditions).is_some_and(|cs| {
                cs.iter()
                    .any(|c| c.type_ == "Established" && c.status == "True")
            });
            if established {
                break;
            }
            if Instant::now() > deadline {
                return Err(Error::NotReady {
                    name: name.clone(),
                    reason: "CRD not Established after 30 s".into(),
                    log: String::new(),
                });
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    Ok(names)
}

/// Polls `check` every 100 ms until it yields `Some(value)`, or fails after `timeout` with a
/// message that says what was awaited and what was last seen. Tests use it for "eventually"
/// assertions against controllers.
pub async fn eventually<T, F, Fut>(what: &str, timeout: Duration, mut check: F) -> Result<T, String>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<Option<T>, String>>,
{
    let deadline = Instant::now() + timeout;
    let mut last = String::from("nothing yet");
    loop {
        match check().await {
            Ok(Some(v)) => return Ok(v),
            Ok(None) => {}
            Err(e) => last = e,
        }
        if Instant::now() > deadline {
            return Err(format!(
                "timed out after {timeout:?} waiting for {what}; last error: {last}"
            ));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn lws_starts_again_when_a_port_picked_for_it_is_taken_before_it_binds() {
        // A port this test holds: the first start's health probe cannot bind it, as when
        // another process takes a port between its picking and the controller's start.
        let busy = TcpListener::bind("127.0.0.1:0").expect("a loopback port");
        let taken = busy.local_addr().expect("its address").port();
        let picks = Arc::new(AtomicU32::new(0));
        let counted = Arc::clone(&picks);
        let ports: PortSource = Box::new(move || {
            let [hook, health] = two_free_ports()?;
            let first = counted.fetch_add(1, Ordering::SeqCst) == 0;
            Ok([hook, if first { taken } else { health }])
        });
        let options = Options {
            scheduler: false,
            kwok: false,
            ..Options::default()
        };
        let cluster = TestCluster::start_with_ports(options, ports)
            .expect("LWS's webhooks answer after a second start");
        assert_eq!(picks.load(Ordering::SeqCst), 2, "one start per pick");
        let first = cluster.dir.join("lws-controller.start1.log");
        let first = std::fs::read_to_string(&first).expect("the first start's log is kept");
        assert!(first.contains("address already in use"), "{first}");
        assert!(!cluster
            .log_tail("lws-controller", 4000)
            .contains("address already in use"));
        drop(busy);
    }
}
