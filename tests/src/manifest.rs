//! The artefacts under deploy/ as the tests read them: Kubernetes objects
//! from the YAML (parsed by PyYAML, which the Python Kubernetes client
//! brings, into JSON), so that a test runs what the manifest says and
//! nothing copied by hand.

use std::{
    path::{Path, PathBuf},
    process::Command,
};

use crate::kube::python;

/// The workspace root.
pub fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("the workspace")
        .to_path_buf()
}

/// deploy/kubernetes/daemonset.yaml
pub fn daemonset_path() -> PathBuf {
    repo().join("deploy/kubernetes/daemonset.yaml")
}

/// deploy/kubernetes/configmap.yaml
pub fn configmap_path() -> PathBuf {
    repo().join("deploy/kubernetes/configmap.yaml")
}

/// deploy/kubernetes/uninstall/uninstall.yaml: the cleanup manifest.
pub fn uninstall_path() -> PathBuf {
    repo().join("deploy/kubernetes/uninstall/uninstall.yaml")
}

/// deploy/systemd/socklb.service
pub fn unit_path() -> PathBuf {
    repo().join("deploy/systemd/socklb.service")
}

/// Every document of a YAML file, as JSON.
pub fn read_yaml(path: &Path) -> Vec<serde_json::Value> {
    let script = r#"
import json, sys, yaml
print(json.dumps([doc for doc in yaml.safe_load_all(open(sys.argv[1])) if doc is not None]))
"#;
    let output = Command::new(python())
        .arg("-c")
        .arg(script)
        .arg(path)
        .output()
        .expect("python");
    assert!(
        output.status.success(),
        "{}: {}",
        path.display(),
        String::from_utf8_lossy(&output.stderr)
    );
    serde_json::from_slice(&output.stdout).expect("the YAML as JSON")
}

/// The object of this kind and name in a YAML file.
pub fn object(path: &Path, kind: &str, name: &str) -> serde_json::Value {
    read_yaml(path)
        .into_iter()
        .find(|doc| doc["kind"] == kind && doc["metadata"]["name"] == name)
        .unwrap_or_else(|| panic!("{}: no {kind} {name}", path.display()))
}

/// The pod spec of a DaemonSet's template.
pub fn pod_spec(daemonset: &serde_json::Value) -> serde_json::Value {
    daemonset["spec"]["template"]["spec"].clone()
}

/// The pod spec of the socklb DaemonSet.
pub fn daemonset_pod_spec() -> serde_json::Value {
    pod_spec(&object(&daemonset_path(), "DaemonSet", "socklb"))
}

/// A container of a pod spec, by name, among its containers or its init
/// containers.
pub fn container(pod_spec: &serde_json::Value, name: &str) -> serde_json::Value {
    ["initContainers", "containers"]
        .iter()
        .filter_map(|list| pod_spec[list].as_array())
        .flatten()
        .find(|container| container["name"] == name)
        .unwrap_or_else(|| panic!("the pod has no container {name}"))
        .clone()
}

/// The socklb container of the DaemonSet.
pub fn daemonset_container() -> serde_json::Value {
    container(&daemonset_pod_spec(), "socklb")
}

/// A file of the socklb ConfigMap (`data.<key>`).
pub fn configmap_file(key: &str) -> String {
    object(&configmap_path(), "ConfigMap", "socklb")["data"][key]
        .as_str()
        .unwrap_or_else(|| panic!("the ConfigMap has no {key}"))
        .to_string()
}

/// A `command` or `args` list of strings.
pub fn strings(value: &serde_json::Value) -> Vec<String> {
    value
        .as_array()
        .map(|words| {
            words
                .iter()
                .map(|word| word.as_str().expect("a string").to_string())
                .collect()
        })
        .unwrap_or_default()
}

/// One `Key=value` line of the systemd unit.
pub fn unit_setting(unit: &str, key: &str) -> String {
    unit.lines()
        .find_map(|line| line.strip_prefix(&format!("{key}=")))
        .unwrap_or_else(|| panic!("the unit sets {key}"))
        .to_string()
}
