"""Writes every ```cpp block of README.md as a C++ file that compiles on its own.

A block with `int main(` is a whole program and is compiled as it stands after the prelude, in
a file of its own. The other blocks are fragments that build on the README's training loop and
on each other (a later one may use what an earlier one declared), so they become, in README
order, the body of one function that receives the names the two loops define (net, comm, model,
optimizer; groups, muon, adamw). Usage: extract_readme_samples.py README.md OUT_DIR; prints the files written, one
per line.
"""
import pathlib
import re
import sys

PRELUDE = """\
// Generated from README.md by tests/docs/extract_readme_samples.py: edit the README instead.
#include <fsdp_muon/fsdp_muon.h>
#include <torch/torch.h>

namespace {
// What the README's samples take as given: the user's model, loss and batch.
struct NetImpl : torch::nn::Module {
  NetImpl() { fc = register_module("fc", torch::nn::Linear(4, 4)); }
  torch::Tensor forward(const torch::Tensor& input) { return fc->forward(input); }
  torch::nn::Linear fc{nullptr};
};
TORCH_MODULE(Net);
[[maybe_unused]] torch::Tensor loss_fn(const torch::Tensor& out, const torch::Tensor& target) {
  return torch::mse_loss(out, target);
}
[[maybe_unused]] torch::Tensor x, y;
}  // namespace
"""

FRAGMENT = """\
[[maybe_unused]] void readme_fragments(
    [[maybe_unused]] Net& net, [[maybe_unused]] std::shared_ptr<fsdp_muon::Communicator> comm,
    [[maybe_unused]] std::vector<std::shared_ptr<fsdp_muon::FsdpParameterGroup>> groups,
    [[maybe_unused]] fsdp_muon::FsdpMuon& muon, [[maybe_unused]] torch::optim::AdamW& adamw,
    [[maybe_unused]] std::shared_ptr<fsdp_muon::ShardedModel> model,
    [[maybe_unused]] fsdp_muon::MuonAdamW& optimizer) {{
{body}
}}
"""


def main() -> None:
    readme, out_dir = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
    blocks = re.findall(r"^```cpp\n(.*?)^```", readme.read_text(), flags=re.S | re.M)
    if not blocks:
        sys.exit(f"{readme}: no ```cpp blocks found")
    out_dir.mkdir(parents=True, exist_ok=True)
    files = {}
    for index, block in enumerate(b for b in blocks if "int main(" in b):
        files[f"readme_program_{index}.cpp"] = PRELUDE + "\n" + block
    fragments = "\n".join(b for b in blocks if "int main(" not in b)
    if fragments:
        # A fragment's #include lines (an engine-tier header) go above the function.
        includes = [l for l in fragments.splitlines() if l.startswith("#include")]
        body = "\n".join(l for l in fragments.splitlines() if not l.startswith("#include"))
        files["readme_fragments.cpp"] = (
            PRELUDE + "".join(i + "\n" for i in includes) + "\nnamespace {\n" +
            FRAGMENT.format(body=body) + "}  // namespace\n")
    for name, code in files.items():
        path = out_dir / name
        if not path.exists() or path.read_text() != code:  # unchanged: no rebuild
            path.write_text(code)
        print(path)


if __name__ == "__main__":
    main()
