//! Compiles the C++ shim of the PyTorch integration (`shim/torch.cpp`) into the library.

fn main() {
    println!("cargo:rerun-if-changed=shim/torch.cpp");
    cc::Build::new()
        .cpp(true)
        .std("c++17")
        .file("shim/torch.cpp")
        .flag_if_supported("-fvisibility=default")
        .warnings(true)
        .extra_warnings(true)
        .warnings_into_errors(true)
        .compile("streamalloc_torch_shim");
}
