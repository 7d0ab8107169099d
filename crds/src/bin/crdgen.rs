//! `crdgen`: prints the LLMService CustomResourceDefinition (`make crds` writes it to
//! `crds/llmservice.yaml`).

#![forbid(unsafe_code)]

fn main() {
    match ferrite_crds::crd_yaml() {
        Ok(yaml) => print!("{yaml}"),
        Err(e) => {
            eprintln!("error: cannot render the CRD: {e}");
            std::process::exit(1);
        }
    }
}
