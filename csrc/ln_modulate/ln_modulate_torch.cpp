// CUDA implementations of the ds_adaptive::ln_modulate / ln_modulate_backward ops (schemas,
// autograd, CPU and Meta implementations: ln_modulate_ops.cpp): argument checks, stride handling,
// output allocation and the launches, no host synchronisation. Plus the Python module of the
// extension: kernel policy, tuning hook and kernel description (control functions), and `apply`,
// the eager entry point of ds_adaptive.ops.ln_modulate (the public op called unboxed through the
// dispatcher; torch.compile and other callers use torch.ops.ds_adaptive).
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/cuda/EmptyTensor.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#include <ATen/PythonTorchFunctionTLS.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/extension.h>
#include <torch/library.h>

#include <optional>
#include <string>
#include <vector>

#include "ln_modulate.h"

namespace lnm = ds_adaptive::ln_modulate;

namespace {

lnm::DType to_dtype(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return lnm::DType::kFloat32;
    case at::kHalf: return lnm::DType::kFloat16;
    case at::kBFloat16: return lnm::DType::kBFloat16;
    default: TORCH_CHECK(false, "ln_modulate: x must be float32, float16 or bfloat16, got ", t);
  }
  return lnm::DType::kFloat32;
}

bool aligned(const void* p, int64_t bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

// (sb, ss) element strides of a [B, S|1, D] tensor read as [B, S, D]; size-1 dims read as stride 0.
struct Strides3 {
  int64_t sb = 0, ss = 0;
};
Strides3 strides_of(const at::Tensor& t) {
  Strides3 s;
  s.sb = t.size(0) == 1 ? 0 : t.stride(0);
  s.ss = t.size(1) == 1 ? 0 : t.stride(1);
  return s;
}

// Can a [B, S, D] operand of element size `esize` be read VEC elements at a time?
bool vec_ok(const at::Tensor& t, const Strides3& s, int vec) {
  const int64_t bytes = std::min<int64_t>(16, (int64_t)vec * t.element_size());
  return aligned(t.data_ptr(), bytes) && s.sb % vec == 0 && s.ss % vec == 0;
}

void check_x(const at::Tensor& x, const char* name) {
  TORCH_CHECK(x.is_cuda(), "ln_modulate: ", name, " must be a CUDA tensor, got device ", x.device());
  TORCH_CHECK(x.dim() == 3, "ln_modulate: ", name, " must be [B, S, D], got shape ", x.sizes());
  TORCH_CHECK(x.size(2) == 1 || x.stride(2) == 1, "ln_modulate: ", name,
              " must have a contiguous last dimension (stride 1), got strides ", x.strides(),
              " (the Python wrapper copies such inputs)");
  to_dtype(x.scalar_type());
}

void check_mod(const at::Tensor& m, const at::Tensor& x, const char* name) {
  TORCH_CHECK(m.device() == x.device(), "ln_modulate: ", name, " is on ", m.device(), " but x is on ", x.device());
  TORCH_CHECK(m.dim() == 3 && m.size(0) == x.size(0) && (m.size(1) == 1 || m.size(1) == x.size(1)) &&
                  m.size(2) == x.size(2),
              "ln_modulate: ", name, " must be [B, 1, D] or [B, S, D] = [", x.size(0), ", 1 or ", x.size(1), ", ",
              x.size(2), "], got ", m.sizes());
  TORCH_CHECK(m.size(2) == 1 || m.stride(2) == 1, "ln_modulate: ", name,
              " must have a contiguous last dimension (stride 1), got strides ", m.strides());
  TORCH_CHECK(m.scalar_type() == at::kFloat || m.scalar_type() == x.scalar_type(), "ln_modulate: ", name,
              " must be float32 or x's dtype (", x.scalar_type(), "), got ", m.scalar_type());
}

void check_affine(const std::optional<at::Tensor>& t, const at::Tensor& x, const char* name) {
  if (!t.has_value()) return;
  TORCH_CHECK(t->device() == x.device(), "ln_modulate: ", name, " is on ", t->device(), " but x is on ", x.device());
  TORCH_CHECK(t->scalar_type() == at::kFloat && t->dim() == 1 && t->size(0) == x.size(2) && t->is_contiguous(),
              "ln_modulate: ", name, " must be a contiguous float32 [D = ", x.size(2), "] tensor, got ",
              t->scalar_type(), " ", t->sizes());
}

const float* opt_ptr(const std::optional<at::Tensor>& t) {
  return t.has_value() ? t->data_ptr<float>() : nullptr;
}

// Output allocation straight from the CUDA caching allocator: the tensor at::empty would return,
// without a dispatcher round trip per output (issue 18: each cost ~2-5 us of host time on the H200
// host, nine per fwd+bwd).
at::Tensor new_cuda(at::IntArrayRef size, at::ScalarType dtype, const at::Tensor& like) {
  return at::Tensor(at::detail::empty_cuda(size, dtype, like.device(), std::nullopt));
}

void check_cuda(cudaError_t e, const char* what) {
  TORCH_CHECK(e == cudaSuccess, "ln_modulate: ", what, " failed: ", cudaGetErrorString(e));
}

}  // namespace

namespace {

// y [B, S, D] (x.dtype), mean [B, S] fp32, rstd [B, S] fp32.
std::tuple<at::Tensor, at::Tensor, at::Tensor> ln_modulate_forward(const at::Tensor& x, const at::Tensor& shift, const at::Tensor& scale,
                                            const std::optional<at::Tensor>& weight,
                                            const std::optional<at::Tensor>& bias, double eps) {
  check_x(x, "x");
  check_mod(shift, x, "shift");
  check_mod(scale, x, "scale");
  TORCH_CHECK(shift.scalar_type() == scale.scalar_type(), "ln_modulate: shift and scale must share a dtype, got ",
              shift.scalar_type(), " and ", scale.scalar_type());
  check_affine(weight, x, "weight");
  check_affine(bias, x, "bias");
  const int64_t B = x.size(0), S = x.size(1), D = x.size(2);
  TORCH_CHECK(D >= 1, "ln_modulate: D must be >= 1, got ", D);
  const c10::cuda::CUDAGuard guard(x.device());
  auto y = new_cuda({B, S, D}, x.scalar_type(), x);
  auto mean = new_cuda({B, S}, at::kFloat, x);
  auto rstd = new_cuda({B, S}, at::kFloat, x);
  if (B * S == 0) return {y, mean, rstd};

  const lnm::DType xt = to_dtype(x.scalar_type());
  const lnm::DType mt = to_dtype(scale.scalar_type());
  const int vec = 16 / (int)x.element_size();
  lnm::FwdParams p;
  p.B = B;
  p.S = S;
  p.D = (int)D;
  const Strides3 xs = strides_of(x), shs = strides_of(shift), scs = strides_of(scale);
  p.x = x.data_ptr();
  p.x_sb = xs.sb;
  p.x_ss = xs.ss;
  p.shift = shift.data_ptr();
  p.shift_sb = shs.sb;
  p.shift_ss = shs.ss;
  p.scale = scale.data_ptr();
  p.scale_sb = scs.sb;
  p.scale_ss = scs.ss;
  p.weight = opt_ptr(weight);
  p.bias = opt_ptr(bias);
  p.y = y.data_ptr();
  p.mean = mean.data_ptr<float>();
  p.rstd = rstd.data_ptr<float>();
  p.eps = (float)eps;
  p.vectorized = D % vec == 0 && vec_ok(x, xs, vec) && vec_ok(shift, shs, vec) && vec_ok(scale, scs, vec) &&
                 (!p.weight || aligned(p.weight, 16)) && (!p.bias || aligned(p.bias, 16));
  TORCH_CHECK(D <= lnm::ln_modulate_max_d(xt, p.vectorized), "ln_modulate: D = ", D,
              " exceeds the register-resident limit of the fused kernel (",
              lnm::ln_modulate_max_d(xt, p.vectorized), " for this dtype / alignment)");
  check_cuda(lnm::ln_modulate_fwd(p, xt, mt, c10::cuda::getCurrentCUDAStream()), "forward launch");
  return {y, mean, rstd};
}

// Returns (dx [B,S,D] x.dtype, dshift, dscale, dweight [D] fp32, dbias [D] fp32):
//   per-sample scale ([B,1,D]): dshift, dscale [B,1,D] in scale.dtype;
//   per-token scale ([B,S,D]):  dscale [B,S,D] in scale.dtype, dshift [B,S,D] when need_dshift
//                               (else an empty tensor: the caller uses dy itself);
//   dweight / dbias: empty when weight / bias is None.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> ln_modulate_backward(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& mean,
                                             const at::Tensor& rstd, const at::Tensor& scale,
                                             const std::optional<at::Tensor>& weight,
                                             const std::optional<at::Tensor>& bias, bool need_dshift) {
  check_x(x, "x");
  check_x(dy, "dy");
  TORCH_CHECK(dy.sizes() == x.sizes() && dy.scalar_type() == x.scalar_type() && dy.device() == x.device(),
              "ln_modulate: dy must match x (", x.scalar_type(), " ", x.sizes(), "), got ", dy.scalar_type(), " ",
              dy.sizes());
  check_mod(scale, x, "scale");
  check_affine(weight, x, "weight");
  check_affine(bias, x, "bias");
  TORCH_CHECK(!bias.has_value() || weight.has_value(), "ln_modulate: bias without weight is not supported");
  const int64_t B = x.size(0), S = x.size(1), D = x.size(2);
  TORCH_CHECK(mean.scalar_type() == at::kFloat && rstd.scalar_type() == at::kFloat && mean.is_contiguous() &&
                  rstd.is_contiguous() && mean.numel() == B * S && rstd.numel() == B * S,
              "ln_modulate: mean / rstd must be contiguous float32 [B, S] (from the forward)");
  const c10::cuda::CUDAGuard guard(x.device());
  const bool per_sample = scale.size(1) == 1;
  const at::ScalarType mdt = scale.scalar_type();

  auto dx = new_cuda({B, S, D}, x.scalar_type(), x);
  at::Tensor dshift, dscale;
  at::Tensor dshift_f, dscale_f;  // fp32 finalize targets (per-sample), [B, 1, D]
  if (per_sample) {
    dshift_f = new_cuda({B, 1, D}, at::kFloat, x);
    dscale_f = new_cuda({B, 1, D}, at::kFloat, x);
  } else {
    dscale = new_cuda({B, S, D}, mdt, x);
    dshift = need_dshift ? new_cuda({B, S, D}, mdt, x) : new_cuda({0}, mdt, x);
  }
  auto dweight = new_cuda({weight.has_value() ? D : 0}, at::kFloat, x);
  auto dbias = new_cuda({bias.has_value() ? D : 0}, at::kFloat, x);

  auto finish = [&]() -> std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> {
    if (per_sample) {
      dshift = mdt == at::kFloat ? dshift_f : dshift_f.to(mdt);
      dscale = mdt == at::kFloat ? dscale_f : dscale_f.to(mdt);
    }
    return {dx, dshift, dscale, dweight, dbias};
  };
  if (B * S == 0) {
    if (per_sample) {
      dshift_f.zero_();
      dscale_f.zero_();
    }
    dweight.zero_();
    dbias.zero_();
    return finish();
  }

  const lnm::DType xt = to_dtype(x.scalar_type());
  const lnm::DType mt = to_dtype(scale.scalar_type());
  const int vec = 16 / (int)x.element_size();
  lnm::BwdParams p;
  p.B = B;
  p.S = S;
  p.D = (int)D;
  const Strides3 dys = strides_of(dy), xs = strides_of(x), scs = strides_of(scale);
  p.dy = dy.data_ptr();
  p.dy_sb = dys.sb;
  p.dy_ss = dys.ss;
  p.x = x.data_ptr();
  p.x_sb = xs.sb;
  p.x_ss = xs.ss;
  p.mean = mean.data_ptr<float>();
  p.rstd = rstd.data_ptr<float>();
  p.scale = scale.data_ptr();
  p.scale_sb = scs.sb;
  p.scale_ss = scs.ss;
  p.weight = opt_ptr(weight);
  p.bias = opt_ptr(bias);
  p.dx = dx.data_ptr();
  p.per_sample = per_sample;
  if (!per_sample) {
    p.dscale_tok = dscale.data_ptr();
    p.dshift_tok = need_dshift ? dshift.data_ptr() : nullptr;
  }
  p.vectorized = D % vec == 0 && vec_ok(dy, dys, vec) && vec_ok(x, xs, vec) && vec_ok(scale, scs, vec) &&
                 (!p.weight || aligned(p.weight, 16)) && (!p.bias || aligned(p.bias, 16));
  TORCH_CHECK(D <= lnm::ln_modulate_max_d(xt, p.vectorized), "ln_modulate: D = ", D,
              " exceeds the register-resident limit of the fused kernel (",
              lnm::ln_modulate_max_d(xt, p.vectorized), " for this dtype / alignment)");

  const int64_t nfloats = lnm::ln_modulate_bwd_plan(p, xt, mt, 0);
  TORCH_CHECK(p.grid > 0, "ln_modulate: no backward kernel for D = ", D);
  at::Tensor partial;
  if (nfloats > 0) {
    partial = new_cuda({nfloats}, at::kFloat, x);
    p.partial = partial.data_ptr<float>();
  }
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  check_cuda(lnm::ln_modulate_bwd(p, xt, mt, stream), "backward launch");
  if (p.nq > 0) {
    lnm::FinalizeParams f;
    f.partial = p.partial;
    f.num_tiles = p.num_tiles;
    f.tiles_per_seg = p.tiles_per_seg;
    f.nq = p.nq;
    f.D = (int)D;
    f.B = per_sample ? B : 0;
    f.dshift = per_sample ? dshift_f.data_ptr<float>() : nullptr;
    f.dscale = per_sample ? dscale_f.data_ptr<float>() : nullptr;
    f.dweight = weight.has_value() ? dweight.data_ptr<float>() : nullptr;
    f.dbias = bias.has_value() ? dbias.data_ptr<float>() : nullptr;
    f.q_mod = 0;
    f.q_aff = per_sample ? 2 : 0;
    check_cuda(lnm::ln_modulate_finalize(f, stream), "finalize launch");
  }
  return finish();
}

}  // namespace

TORCH_LIBRARY_IMPL(ds_adaptive, CUDA, m) {
  m.impl("ln_modulate", &ln_modulate_forward);
  m.impl("ln_modulate_backward", &ln_modulate_backward);
}

int64_t ln_modulate_max_d_py(const std::string& dtype, bool vectorized) {
  lnm::DType t = lnm::DType::kFloat32;
  if (dtype == "bfloat16") t = lnm::DType::kBFloat16;
  else if (dtype == "float16") t = lnm::DType::kFloat16;
  else TORCH_CHECK(dtype == "float32", "ln_modulate.max_d: dtype must be float32, float16 or bfloat16");
  return lnm::ln_modulate_max_d(t, vectorized);
}

bool ln_modulate_set_tuning_py(int64_t slot, int64_t variant) {
  return lnm::ln_modulate_set_tuning((int)slot, (int)variant);
}

std::vector<int64_t> policy_list(const lnm::KernelPolicy& k) {
  return {k.fwd_sample, k.fwd_token, k.bwd_sample, k.bwd_token, k.finalize};
}

// Kernel-generation policy as [fwd_sample, fwd_token, bwd_sample, bwd_token, finalize] (1 or 2).
std::vector<int64_t> ln_modulate_get_kernels_py() { return policy_list(lnm::ln_modulate_get_policy()); }
std::vector<int64_t> ln_modulate_default_kernels_py() { return policy_list(lnm::ln_modulate_default_policy()); }

void ln_modulate_set_kernels_py(const std::vector<int64_t>& v) {
  TORCH_CHECK(v.size() == 5, "ln_modulate.set_kernels: expected 5 values [fwd_sample, fwd_token, bwd_sample, "
              "bwd_token, finalize], got ", v.size());
  lnm::KernelPolicy k;
  k.fwd_sample = (int)v[0];
  k.fwd_token = (int)v[1];
  k.bwd_sample = (int)v[2];
  k.bwd_token = (int)v[3];
  k.finalize = (int)v[4];
  TORCH_CHECK(lnm::ln_modulate_set_policy(k), "ln_modulate.set_kernels: every value must be 1 or 2, got ", v);
}

// Kernel configuration that a call with these shapes would use: fwd threads/CTA, fwd rows/CTA,
// bwd threads/CTA, fwd resident CTAs (the persistent grid), bwd tiles, bwd rows per tile, fwd and
// bwd kernel generation (1 = v1, 2 = v2), fwd and bwd dynamic shared memory (bytes), bwd grid.
std::vector<int64_t> ln_modulate_describe_py(const at::Tensor& x, const at::Tensor& scale, bool affine) {
  check_x(x, "x");
  check_mod(scale, x, "scale");
  const c10::cuda::CUDAGuard guard(x.device());
  const lnm::DType xt = to_dtype(x.scalar_type());
  const lnm::DType mt = to_dtype(scale.scalar_type());
  const int vec = 16 / (int)x.element_size();
  static float dummy[4] = {0, 0, 0, 0};
  lnm::FwdParams fp;
  fp.B = x.size(0);
  fp.S = x.size(1);
  fp.D = (int)x.size(2);
  fp.vectorized = x.size(2) % vec == 0;
  const Strides3 scs = strides_of(scale);  // per-token modulation selects other forward kernels
  fp.shift_sb = fp.scale_sb = scs.sb;
  fp.shift_ss = fp.scale_ss = scs.ss;
  lnm::BwdParams bp;
  bp.B = fp.B;
  bp.S = fp.S;
  bp.D = fp.D;
  bp.per_sample = scale.size(1) == 1;
  bp.vectorized = fp.vectorized;
  bp.weight = affine ? dummy : nullptr;
  int out[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  lnm::ln_modulate_describe(fp, bp, xt, mt, out);
  lnm::ln_modulate_bwd_plan(bp, xt, mt, 0);
  return {out[0], out[1], out[2], out[3], bp.num_tiles, bp.rows_per_tile, out[4], bp.gen, out[6], out[7], bp.grid};
}

// Eager entry point of ds_adaptive.ops.ln_modulate: the ln_modulate_apply op called unboxed through
// the dispatcher (the same kernels, autograd and dispatch keys / modes as torch.ops), without
// torch.ops' Python argument parsing and boxing (issue 18: host time per call). The Python layer
// takes torch.ops instead under torch.compile and for tensor subclasses / torch-function modes.
at::Tensor ln_modulate_apply_py(const at::Tensor& x, const at::Tensor& shift, const at::Tensor& scale, double eps,
                                const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias) {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("ds_adaptive::ln_modulate_apply", "")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, double,
                            const std::optional<at::Tensor>&, const std::optional<at::Tensor>&)>();
  return op.call(x, shift, scale, eps, weight, bias);
}

// The eager fast path of ds_adaptive.ops.ln_modulate in one C++ call: the conditions the Python layer
// used to check per call (issue 18, host time: ~3 us of Python on the H200 host at 91c7a84) checked
// here, then `apply`. Takes the call when x, shift, scale (and weight / bias unless None) are plain
// tensors (torch.Tensor or nn.Parameter, whose __torch_function__ is disabled; no other subclass), no
// torch-function mode is active, and x is a CUDA [B, S, D] tensor of a kernel dtype with D within every
// path's limit (kMaxDScalar); returns None otherwise, and the Python layer takes its checked path.
// Argument errors of the op propagate (as RuntimeError: the Python layer then raises its own message).
py::object ln_modulate_try_apply_py(py::handle x, py::handle shift, py::handle scale, double eps, py::handle weight,
                                    py::handle bias) {
  const auto plain = [](py::handle h) { return THPVariable_CheckExact(h.ptr()); };
  const auto plain_or_none = [&](py::handle h) { return h.is_none() || plain(h); };
  if (!plain(x) || !plain(shift) || !plain(scale) || !plain_or_none(weight) || !plain_or_none(bias) ||
      at::impl::torch_function_mode_enabled())
    return py::none();
  const at::Tensor& xt = THPVariable_Unpack(x.ptr());
  const at::ScalarType dt = xt.scalar_type();
  if (!xt.is_cuda() || xt.dim() != 3 || xt.size(2) > lnm::kMaxDScalar ||
      (dt != at::kFloat && dt != at::kHalf && dt != at::kBFloat16))
    return py::none();
  const std::optional<at::Tensor> w =
      weight.is_none() ? std::nullopt : std::optional<at::Tensor>(THPVariable_Unpack(weight.ptr()));
  const std::optional<at::Tensor> b =
      bias.is_none() ? std::nullopt : std::optional<at::Tensor>(THPVariable_Unpack(bias.ptr()));
  at::Tensor y;
  {
    py::gil_scoped_release no_gil;
    y = ln_modulate_apply_py(xt, THPVariable_Unpack(shift.ptr()), THPVariable_Unpack(scale.ptr()), eps, w, b);
  }
  return py::reinterpret_steal<py::object>(THPVariable_Wrap(std::move(y)));
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "ds_adaptive fused LayerNorm-Modulate: control functions and the eager entry point `apply` (the ops are torch.ops.ds_adaptive.*)";
  m.def("apply", &ln_modulate_apply_py,
        "ds_adaptive::ln_modulate_apply(x, shift, scale, eps, weight, bias) without torch.ops' Python layer",
        py::arg("x"), py::arg("shift"), py::arg("scale"), py::arg("eps"), py::arg("weight"), py::arg("bias"),
        py::call_guard<py::gil_scoped_release>());
  m.def("try_apply", &ln_modulate_try_apply_py,
        "the eager fast path: `apply` when every argument is a plain tensor (or None), no torch-function mode "
        "is active and x is a CUDA [B, S, D] tensor of a kernel dtype with D <= 8192; None otherwise",
        py::arg("x"), py::arg("shift"), py::arg("scale"), py::arg("eps"), py::arg("weight"), py::arg("bias"));
  m.def("max_d", &ln_modulate_max_d_py, "largest D the kernels hold in registers", py::arg("dtype"),
        py::arg("vectorized"));
  m.def("set_tuning", &ln_modulate_set_tuning_py, "benchmark hook: kernel-config variant per slot", py::arg("slot"),
        py::arg("variant"));
  m.def("describe", &ln_modulate_describe_py, "kernel configuration for these shapes", py::arg("x"),
        py::arg("scale"), py::arg("affine") = false);
  m.def("get_kernels", &ln_modulate_get_kernels_py,
        "kernel-generation policy [fwd_sample, fwd_token, bwd_sample, bwd_token, finalize] (1 = v1, 2 = v2)");
  m.def("default_kernels", &ln_modulate_default_kernels_py, "the compiled-in kernel-generation policy");
  m.def("set_kernels", &ln_modulate_set_kernels_py, "set the kernel-generation policy (5 values, each 1 or 2)",
        py::arg("policy"));
}
