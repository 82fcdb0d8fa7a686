//! The Kubernetes manifests (deploy/kubernetes), checked offline: every overlay renders with
//! kubectl's kustomize, every object validates (Kubernetes' schemas, strict; KEDA's and the
//! Prometheus Operator's resource models), each worker pool has its KEDA ScaledObject scaling
//! it from zero, and the check does fail a broken manifest.

use std::path::{Path, PathBuf};
use std::process::Command;

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap().to_path_buf()
}

#[test]
fn every_overlay_renders_and_validates_with_a_scaled_object_per_worker_pool() {
    let out = Command::new("bash").arg(repo().join("scripts/kubernetes-check.sh")).output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    println!("{stdout}{}", String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "the check failed");
    let rendered = tern_e2e::state_dir().join("kubernetes/rendered");
    for (overlay, pools) in [("cpu", &["cpu"][..]), ("gpu", &["gpu"]), ("production", &["cpu", "gpu"])] {
        assert!(stdout.contains(&format!("rendered deploy/kubernetes/overlays/{overlay}/")), "{overlay} rendered");
        let file = rendered.join(format!("{overlay}.yaml"));
        let yaml = std::fs::read_to_string(&file).unwrap();
        for pool in pools {
            let name = format!("tern-worker-{pool}");
            assert!(stdout.contains(&format!("{}: ScaledObject/{name}: ok", file.display())), "{overlay}: {name} scaled");
            assert!(stdout.contains(&format!("{}: Deployment/{name}: ok", file.display())));
        }
        assert!(yaml.contains("minReplicaCount: 0"), "{overlay}: pools scale to zero");
        assert!(yaml.contains("path: /readyz"), "{overlay}: the API is ready on /readyz");
        assert!(!stdout.contains("INVALID"));
    }
    let production = std::fs::read_to_string(rendered.join("production.yaml")).unwrap();
    assert!(production.contains("nvidia.com/gpu: 1"), "GPU workers ask for a GPU");

    assert!(stdout.contains("production.yaml: pool tern-worker-gpu (audio_embed,generate,image,transcribe): ok"), "each kind a pool serves wakes it");

    // The same objects, broken: a ScaledObject without its target, a Deployment field
    // misspelled, a pool serving a kind no trigger counts. The check names each and fails.
    let broken = production
        .replacen("  scaleTargetRef:\n    name: tern-worker-cpu\n", "", 1)
        .replacen("  replicas: 3\n", "  replica: 3\n", 1)
        .replacen("value: transcribe,audio_embed,generate,image", "value: transcribe,audio_embed,generate,image,embed", 1);
    assert_ne!(broken, production);
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("broken.yaml");
    std::fs::write(&path, broken).unwrap();
    let python = tern_e2e::state_dir().join("kubernetes/venv/bin/python");
    let out = Command::new(python).arg(repo().join("deploy/kubernetes/validate.py")).arg("1.31.0").arg(&path).output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(1), "{stdout}");
    assert!(stdout.contains("ScaledObject/tern-worker-cpu: INVALID") && stdout.contains("scaleTargetRef"), "{stdout}");
    assert!(stdout.contains("Deployment/tern-api: INVALID") && stdout.contains("'replica' was unexpected"), "{stdout}");
    assert!(stdout.contains("pool tern-worker-gpu (audio_embed,embed,generate,image,transcribe): INVALID: kinds served but never counted by a trigger: ['embed']"), "{stdout}");
}
