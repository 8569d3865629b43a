// Matrix decompositions and solves, lowered natively (no LAPACK on the device):
//
//   triangular solves   linalg_solve_triangular, triangular_solve,
//                       _cholesky_solve_helper, cholesky_inverse
//                       -> stablehlo.triangular_solve (XLA expands it into
//                          blocked substitution)
//   Cholesky            linalg_cholesky_ex, cholesky -> a stablehlo.while
//                          loop over the columns (LAPACK's info and partial
//                          factor for non positive-definite input)
//   LU (partial pivot)  linalg_lu_factor_ex, lu_unpack, linalg_lu,
//                       linalg_lu_solve, _linalg_solve_ex, _linalg_det,
//                       _linalg_slogdet, linalg_inv_ex
//                       -> a stablehlo.while loop over the columns (below)
//   QR                  geqrf, linalg_qr, linalg_householder_product, orgqr,
//                       ormqr -> XLA's "Qr" and
//                       "ProductOfElementaryHouseholderReflectors" custom
//                       calls (blocked Householder QR in LAPACK's geqrf
//                       format, expanded by XLA's QrExpander)
//   symmetric eigen     _linalg_eigh -> XLA's "Eigh" custom call (two-sided
//                       Jacobi, expanded by XLA's EighExpander)
//   SVD                 _linalg_svd -> one-sided (Hestenes) Jacobi in a
//                       stablehlo.while loop (below)
//
// Shapes: every op takes [*, m, n] with any number of leading batch dims
// (broadcast between operands where PyTorch broadcasts them). Dtypes: float32
// and float64, as PyTorch's CPU kernels (LAPACK); other dtypes are declined
// (LoweringError: the CPU path then raises PyTorch's own error). Output
// conventions follow LAPACK/PyTorch CPU: pivots int32 1-based, info int32
// (0, or the 1-based index of the first zero pivot / failing minor),
// singular values descending, eigenvalues ascending.
//
// LU: Doolittle elimination with partial pivoting, one loop iteration per
// column j < min(m, n): the pivot is the first row i >= j of largest |a_ij|
// (LAPACK's idamax), rows j and p are swapped (selects with one-hot masks, no
// arithmetic on the moved values), the column below the diagonal is divided
// by the pivot (skipped for a zero pivot, which sets info as dgetf2 does) and
// the trailing block gets the rank-1 update (a select-masked outer product).
// Cost: min(m,n) iterations of O(batch*m*n) elementwise work, the same flops
// as unblocked dgetf2; the program size is independent of n (one loop body),
// so compile time does not grow with the matrix size.
//
// SVD (m >= n; m < n works on A^T): one-sided Jacobi on the columns of A with
// Brent-Luk round-robin ordering: the n (padded to even) columns are split
// into a top and a bottom half, pair i = (top_i, bottom_i); each step rotates
// all n/2 pairs at once (for alpha = |g_p|^2, beta = |g_q|^2,
// gamma = g_p.g_q: zeta = (beta - alpha) / (2 gamma),
// t = sign(zeta) / (|zeta| + sqrt(1 + zeta^2)), c = 1/sqrt(1+t^2), s = c t —
// Golub & Van Loan, "Matrix Computations", 4th ed., section 8.5 and 8.6.3),
// then the columns move one place round the tournament; n-1 steps make a
// sweep covering every pair. A pair is rotated only if
// |gamma| > tol * sqrt(alpha * beta), tol = sqrt(m) * machine epsilon (the
// rounding level of a length-m dot product, LAPACK's gesvj criterion); the
// sweeps stop after the first sweep that rotates no pair, or after
// kMaxSweeps = 20 (one-sided Jacobi converges quadratically once the
// off-diagonal is small; random float32 matrices up to 128 x 128 match
// LAPACK's singular values to 1e-4 relative in the tests). Cost per sweep:
// (n-1) steps of O(batch * (m + n) * n) elementwise work. Then sigma_j = |g_j|, V accumulates the
// rotations, U = G diag(1/sigma). U is re-orthonormalized and completed (for
// full_matrices, or zero singular values) by a Householder QR of U: its Q
// columns times the signs of R's diagonal. Singular values are sorted
// descending with their vectors.
//
// Not identical to CPU: singular vectors and eigenvectors are unique only up
// to sign (compare reconstructions or |U|, as PyTorch's own OpInfos do);
// torch.cholesky (deprecated) returns the partial factor of a non
// positive-definite input instead of raising (linalg.cholesky raises, from
// info). _linalg_det and _linalg_slogdet return the LU of A^T for a
// contiguous A and of A otherwise, as PyTorch's CPU kernels do (their
// backward formulas read LU that way); contiguity comes from
// LoweredArg::contiguous. Whole-graph lowering (torch.compile) sees values
// and assumes contiguous: a graph taking det of a non-contiguous view gets
// the contiguous-case LU, so its gradient can differ (KNOWN LIMIT).
//
// Eigh: XLA's EighExpander (cyclic two-sided Jacobi) with up to kMaxSweeps
// sweeps and its relative off-diagonal tolerance 1e-7 (float32) / 1e-15
// (float64); eigenvalues sorted ascending by the expander.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>


#include "lowering/helpers.h"

namespace torch_tpu::lowering {
namespace {

using hlo::CompareDirection;
using hlo::DotDims;

constexpr int64_t kMaxSweeps = 20;

Value Zeros(Builder& b, const OutputSpec& spec) {
  return Const(b, ToElementType(spec.dtype), 0, spec.sizes);
}

std::vector<Value> AllZeros(Builder& b, const LoweringContext& ctx) {
  std::vector<Value> r;
  for (const auto& o : ctx.outputs) r.push_back(Zeros(b, o));
  return r;
}

bool AnyEmpty(const LoweringContext& ctx) {
  for (const auto& o : ctx.outputs)
    if (Numel(o.sizes) == 0) return true;
  return false;
}

// float32/float64 only, as PyTorch's CPU (LAPACK) kernels.
ElementType ComputeType(const LoweringContext& ctx, at::ScalarType t) {
  if (t == at::kFloat) return ElementType::kF32;
  if (t == at::kDouble) return ElementType::kF64;
  throw LoweringError(ctx.op_name() + ": dtype " + std::string(c10::toString(t)) +
                      " is not lowered (float32 and float64 only, as on CPU)");
}

Value Input(LoweringContext& ctx, std::string_view name, ElementType e) {
  const Value& v = ctx.tensor(name);
  if (v.rank() < 2)
    throw LoweringError(ctx.op_name() + ": " + std::string(name) + " must have at least 2 dimensions, got " +
                        std::to_string(v.rank()));
  return CastElement(ctx.b, v, e);
}

std::vector<int64_t> BatchOf(std::span<const int64_t> dims, int64_t matrix_rank = 2) {
  return {dims.begin(), dims.end() - matrix_rank};
}

std::vector<int64_t> With(std::vector<int64_t> batch, std::initializer_list<int64_t> tail) {
  batch.insert(batch.end(), tail.begin(), tail.end());
  return batch;
}

int64_t Rows(const Value& x) { return x.dims()[static_cast<size_t>(x.rank() - 2)]; }
int64_t Cols(const Value& x) { return x.dims()[static_cast<size_t>(x.rank() - 1)]; }

// x [*, m, n] broadcast to batch + [m, n].
Value ToBatch(Builder& b, const Value& x, std::span<const int64_t> batch, int64_t matrix_rank = 2) {
  std::vector<int64_t> target(batch.begin(), batch.end());
  target.insert(target.end(), x.dims().end() - matrix_rank, x.dims().end());
  if (x.dims() == target) return x;
  return BroadcastTo(b, x, target);
}

// [*, a, b] <-> [B, a, b] (matrix_rank trailing dims kept).
Value Flatten(Builder& b, const Value& x, int64_t matrix_rank = 2) {
  std::vector<int64_t> d{Numel(BatchOf(x.dims(), matrix_rank))};
  d.insert(d.end(), x.dims().end() - matrix_rank, x.dims().end());
  return b.Reshape(x, d);
}
Value Unflatten(Builder& b, const Value& x, std::span<const int64_t> batch) {
  std::vector<int64_t> d(batch.begin(), batch.end());
  d.insert(d.end(), x.dims().begin() + 1, x.dims().end());
  return b.Reshape(x, d);
}

Value MT(Builder& b, const Value& x) {
  std::vector<int64_t> perm;
  for (int64_t i = 0; i < x.rank() - 2; ++i) perm.push_back(i);
  perm.push_back(x.rank() - 1);
  perm.push_back(x.rank() - 2);
  return b.Transpose(x, perm);
}

// Batched matrix product [*, m, k] @ [*, k, n] (same batch dims).
Value MatMul(Builder& b, const Value& x, const Value& y) {
  DotDims d;
  for (int64_t i = 0; i < x.rank() - 2; ++i) {
    d.lhs_batch.push_back(i);
    d.rhs_batch.push_back(i);
  }
  d.lhs_contract = {x.rank() - 1};
  d.rhs_contract = {y.rank() - 2};
  return b.DotGeneral(x, y, d, x.element());
}

Value RowIota(Builder& b, std::span<const int64_t> dims) {
  return b.Iota(TensorType{ElementType::kS32, {dims.begin(), dims.end()}}, static_cast<int64_t>(dims.size()) - 2);
}
Value ColIota(Builder& b, std::span<const int64_t> dims) {
  return b.Iota(TensorType{ElementType::kS32, {dims.begin(), dims.end()}}, static_cast<int64_t>(dims.size()) - 1);
}

// Keeps the lower (col - row <= k) or upper (col - row >= k) triangle, zeros elsewhere.
Value Tri(Builder& b, const Value& x, bool lower, int64_t k = 0) {
  Value diff = b.Sub(ColIota(b, x.dims()), RowIota(b, x.dims()));
  Value kk = Const(b, ElementType::kS32, static_cast<double>(k), x.dims());
  Value keep = b.Compare(diff, kk, lower ? CompareDirection::kLE : CompareDirection::kGE);
  return b.Select(keep, x, ConstLike(b, x, 0));
}

Value Eye(Builder& b, ElementType e, std::span<const int64_t> dims) {
  Value on = b.Compare(RowIota(b, dims), ColIota(b, dims), CompareDirection::kEQ);
  return b.Select(on, Const(b, e, 1, dims), Const(b, e, 0, dims));
}

// The main diagonal [*, min(m, n)] of x [*, m, n] (exact: a masked sum of zeros).
Value Diagonal(Builder& b, const Value& x) {
  const int64_t k = std::min(Rows(x), Cols(x));
  std::vector<int64_t> start(static_cast<size_t>(x.rank()), 0), limit = x.dims(),
      strides(static_cast<size_t>(x.rank()), 1);
  limit[limit.size() - 2] = k;
  limit[limit.size() - 1] = k;
  Value sq = b.Slice(x, start, limit, strides);
  Value on = b.Compare(RowIota(b, sq.dims()), ColIota(b, sq.dims()), CompareDirection::kEQ);
  Value masked = b.Select(on, sq, ConstLike(b, sq, 0));
  int64_t last[] = {x.rank() - 1};
  return ReduceSum(b, masked, last, false);
}

// Slices the last two dims to [r0, r1) x [c0, c1).
Value SliceMatrix(Builder& b, const Value& x, int64_t r0, int64_t r1, int64_t c0, int64_t c1) {
  std::vector<int64_t> start(static_cast<size_t>(x.rank()), 0), limit = x.dims(),
      strides(static_cast<size_t>(x.rank()), 1);
  start[start.size() - 2] = r0;
  start[start.size() - 1] = c0;
  limit[limit.size() - 2] = r1;
  limit[limit.size() - 1] = c1;
  return b.Slice(x, start, limit, strides);
}

// Pads the last two dims with zeros up to rows x cols.
Value PadMatrix(Builder& b, const Value& x, int64_t rows, int64_t cols) {
  std::vector<int64_t> low(static_cast<size_t>(x.rank()), 0), high(static_cast<size_t>(x.rank()), 0),
      interior(static_cast<size_t>(x.rank()), 0);
  high[high.size() - 2] = rows - Rows(x);
  high[high.size() - 1] = cols - Cols(x);
  return b.Pad(x, Const(b, x.element(), 0), low, high, interior);
}

Value S32(Builder& b, int64_t v) { return b.ConstantInt(TensorType{ElementType::kS32, {}}, v); }

// Index of the first true element along the last dim of `pred` [B, n], plus
// one; 0 where none (the LAPACK "info" convention).
Value FirstTrue1Based(Builder& b, const Value& pred) {
  const int64_t n = pred.dims().back();
  Value idx = b.Add(b.Iota(TensorType{ElementType::kS32, pred.dims()}, pred.rank() - 1),
                    Const(b, ElementType::kS32, 1, pred.dims()));
  Value none = Const(b, ElementType::kS32, static_cast<double>(n + 1), pred.dims());
  Value cand = b.Select(pred, idx, none);
  Value init = S32(b, n + 1);
  int64_t last[] = {pred.rank() - 1};
  Value first = b.Reduce(std::span(&cand, 1), std::span(&init, 1), last,
                         [](Builder& bb, std::span<const Value> a) { return std::vector<Value>{bb.Min(a[0], a[1])}; })[0];
  Value is_none = b.Compare(first, ConstLike(b, first, static_cast<double>(n + 1)), CompareDirection::kEQ);
  return b.Select(is_none, ConstLike(b, first, 0), first);
}

// Rows of x [B, m, r] picked by idx [B, m] (s32): out[b, i] = x[b, idx[b, i]].
Value GatherRows(Builder& b, const Value& x, const Value& idx) {
  const int64_t B = x.dims()[0], m = idx.dims()[1], r = x.dims()[2];
  if (B == 0 || m == 0 || r == 0) return Const(b, x.element(), 0, std::vector<int64_t>{B, m, r});
  hlo::GatherDims d;
  d.offset_dims = {2};
  d.collapsed_slice_dims = {1};
  d.start_index_map = {1};
  d.operand_batching_dims = {0};
  d.start_indices_batching_dims = {0};
  d.index_vector_dim = 2;
  int64_t idx_dims[] = {B, m, 1};
  int64_t sizes[] = {1, 1, r};
  return b.Gather(x, b.Reshape(idx, idx_dims), d, sizes, TensorType{x.element(), {B, m, r}});
}

// The inverse of a permutation perm [B, m] (s32): inv[perm[i]] = i.
Value InversePerm(Builder& b, const Value& perm) {
  const int64_t B = perm.dims()[0], m = perm.dims()[1];
  std::vector<int64_t> d3{B, m, m};
  int64_t bd[] = {0, 1};
  Value p3 = b.BroadcastInDim(perm, d3, bd);                              // [b, i, r] = perm[b, i]
  Value r3 = b.Iota(TensorType{ElementType::kS32, d3}, 2);                // r
  Value i3 = b.Iota(TensorType{ElementType::kS32, d3}, 1);                // i
  Value hit = b.Compare(p3, r3, CompareDirection::kEQ);
  Value contrib = b.Select(hit, i3, ConstLike(b, i3, 0));
  int64_t over_i[] = {1};
  return ReduceSum(b, contrib, over_i, false);
}

// ---------------------------------------------------------------------------
// Triangular solves and Cholesky
// ---------------------------------------------------------------------------

// linalg_solve_triangular(A [*, n, n], B [*, n, k] or [*, k, n], upper, left, unitriangular)
std::vector<Value> LowerSolveTriangular(LoweringContext& ctx) {
  auto& b = ctx.b;
  const auto& out = ctx.outputs[0];
  const ElementType e = ComputeType(ctx, out.dtype);
  if (AnyEmpty(ctx)) return AllZeros(b, ctx);
  Value A = Input(ctx, "self", e), B = Input(ctx, "B", e);
  const auto batch = BatchOf(out.sizes);
  A = ToBatch(b, A, batch);
  B = BroadcastTo(b, B, out.sizes);
  Value X = b.TriangularSolve(A, B, ctx.bool_arg("left"), !ctx.bool_arg("upper"), ctx.bool_arg("unitriangular"),
                              false);
  return {Out(b, X, out)};
}

// triangular_solve(b [*, n, k], A [*, n, n], upper, transpose, unitriangular)
//   -> (solution of op(A) X = b, A broadcast to the batch)
std::vector<Value> LowerTriangularSolve(LoweringContext& ctx) {
  auto& b = ctx.b;
  const auto& out = ctx.outputs[0];
  const ElementType e = ComputeType(ctx, out.dtype);
  if (AnyEmpty(ctx)) {
    std::vector<Value> r = AllZeros(b, ctx);
    if (Numel(ctx.outputs[1].sizes) != 0) r[1] = Out(b, Input(ctx, "A", e), ctx.outputs[1]);
    return r;
  }
  Value B = Input(ctx, "self", e), A = Input(ctx, "A", e);
  const auto batch = BatchOf(out.sizes);
  A = ToBatch(b, A, batch);
  B = BroadcastTo(b, B, out.sizes);
  const bool upper = ctx.bool_arg("upper");
  Value X = b.TriangularSolve(A, B, true, !upper, ctx.bool_arg("unitriangular"), ctx.bool_arg("transpose"));
  return {Out(b, X, out), Out(b, A, ctx.outputs[1])};
}

// The Cholesky factor (zeros in the other triangle) and LAPACK's info: the
// order of the first leading minor that is not positive-definite (0 if none).
// Right-looking unblocked Cholesky (LAPACK's potf2) in a while loop over the
// columns, on the matrix symmetrized from the triangle LAPACK reads: column j
// gets l_jj = sqrt(a_jj), l_ij = a_ij / l_jj, and the trailing block the
// rank-1 update a_ik -= l_ij l_kj. A pivot a_jj that is not > 0 (or NaN) sets
// info = j + 1 and freezes that matrix: like LAPACK, the factor then holds
// the finished columns and the partly updated rest. n iterations of
// O(batch * n^2) work; one loop body, so compile time does not grow with n.
// (stablehlo.cholesky, XLA's blocked expander, turns a whole non-PD matrix
// into NaN and reports no failing minor, hence the loop.)
std::pair<Value, Value> CholeskyInfo(Builder& b, const Value& A, bool upper) {
  const auto batch = BatchOf(A.dims());
  Value a3 = Flatten(b, A);
  const int64_t B = a3.dims()[0], n = a3.dims()[1];
  // Symmetric matrix from the lower (or upper) triangle.
  Value tri = Tri(b, a3, !upper);
  Value strict = Tri(b, a3, !upper, upper ? 1 : -1);
  std::vector<int64_t> perm{0, 2, 1};
  Value sym = b.Add(tri, b.Transpose(strict, perm));
  Value info0 = Const(b, ElementType::kS32, 0, std::vector<int64_t>{B});
  Value init[] = {S32(b, 0), sym, info0};
  auto r = b.While(
      init,
      [&](Builder& bb, std::span<const Value> v) {
        return std::vector<Value>{bb.Compare(v[0], S32(bb, n), CompareDirection::kLT)};
      },
      [&](Builder& bb, std::span<const Value> v) {
        const Value& j = v[0];
        Value x = v[1], info = v[2];
        const std::vector<int64_t> d3{B, n, n}, d2{B, n}, d1{B};
        Value z = S32(bb, 0);
        Value st_d[] = {z, j, j};
        int64_t one3[] = {B, 1, 1};
        Value d = bb.Reshape(bb.DynamicSlice(x, st_d, one3), d1);
        Value active = bb.Compare(info, ConstLike(bb, info, 0), CompareDirection::kEQ);
        Value ok = bb.Compare(d, ConstLike(bb, d, 0), CompareDirection::kGT);
        Value jB = bb.BroadcastInDim(j, d1, {});
        info = bb.Select(bb.And(active, bb.Not(ok)), bb.Add(jB, ConstLike(bb, jB, 1)), info);
        Value proceed = bb.And(active, ok);
        int64_t bd0[] = {0};
        Value ljj = bb.BroadcastInDim(bb.Sqrt(d), d2, bd0);
        Value st_c[] = {z, z, j};
        int64_t col_sz[] = {B, n, 1};
        Value col = bb.Reshape(bb.DynamicSlice(x, st_c, col_sz), d2);
        Value r2 = bb.Iota(TensorType{ElementType::kS32, d2}, 1);
        Value j2 = bb.BroadcastInDim(j, d2, {});
        Value below = bb.Compare(r2, j2, CompareDirection::kGT);
        Value l = bb.Select(below, bb.Div(col, ljj),
                            bb.Select(bb.Compare(r2, j2, CompareDirection::kEQ), ljj, ConstLike(bb, col, 0)));
        Value rows = bb.Iota(TensorType{ElementType::kS32, d3}, 1);
        Value cols = bb.Iota(TensorType{ElementType::kS32, d3}, 2);
        Value j3 = bb.BroadcastInDim(j, d3, {});
        int64_t bd01[] = {0, 1}, bd02[] = {0, 2};
        Value li = bb.BroadcastInDim(l, d3, bd01), lk = bb.BroadcastInDim(l, d3, bd02);
        Value trailing = bb.And(bb.Compare(rows, j3, CompareDirection::kGT), bb.Compare(cols, j3, CompareDirection::kGT));
        Value nx = bb.Select(trailing, bb.Sub(x, bb.Mul(li, lk)), x);
        Value colj = bb.And(bb.Compare(cols, j3, CompareDirection::kEQ), bb.Compare(rows, j3, CompareDirection::kGE));
        nx = bb.Select(colj, li, nx);
        x = bb.Select(bb.BroadcastInDim(proceed, d3, bd0), nx, x);
        return std::vector<Value>{bb.Add(j, S32(bb, 1)), x, info};
      });
  Value L = Tri(b, r[1], true);
  if (upper) L = b.Transpose(L, perm);
  return {Unflatten(b, L, batch), b.Reshape(r[2], batch)};
}

// linalg_cholesky_ex(A [*, n, n], upper, check_errors) -> (L, info [*] int32)
std::vector<Value> LowerCholeskyEx(LoweringContext& ctx) {
  auto& b = ctx.b;
  if (ctx.bool_arg("check_errors"))
    throw LoweringError(ctx.op_name() + ": check_errors=True raises from the data; runs on the CPU");
  const ElementType e = ComputeType(ctx, ctx.outputs[0].dtype);
  if (AnyEmpty(ctx)) return AllZeros(b, ctx);
  auto [L, info] = CholeskyInfo(b, Input(ctx, "self", e), ctx.bool_arg("upper"));
  return {Out(b, L, ctx.outputs[0]), Out(b, info, ctx.outputs[1])};
}

// cholesky(A, upper) (deprecated API): the factor; NaN for non positive-definite input.
std::vector<Value> LowerCholesky(LoweringContext& ctx) {
  auto& b = ctx.b;
  const ElementType e = ComputeType(ctx, ctx.outputs[0].dtype);
  if (AnyEmpty(ctx)) return AllZeros(b, ctx);
  Value A = Input(ctx, "self", e);
  return {Out(b, CholeskyInfo(b, A, ctx.bool_arg("upper")).first, ctx.outputs[0])};
}

// X = (L L^T)^-1 B (lower) or (U^T U)^-1 B (upper), with two triangular solves.
Value CholeskySolve(Builder& b, const Value& F, const Value& B, bool upper) {
  if (upper) {
    Value y = b.TriangularSolve(F, B, true, false, false, true);  // U^T y = B
    return b.TriangularSolve(F, y, true, false, false, false);    // U x = y
  }
  Value y = b.TriangularSolve(F, B, true, true, false, false);  // L y = B
  return b.TriangularSolve(F, y, true, true, false, true);      // L^T x = y
}

// _cholesky_solve_helper(B [*, n, k], F [*, n, n], upper)
std::vector<Value> LowerCholeskySolveHelper(LoweringContext& ctx) {
  auto& b = ctx.b;
  const auto& out = ctx.outputs[0];
  const ElementType e = ComputeType(ctx, out.dtype);
  if (AnyEmpty(ctx)) return AllZeros(b, ctx);
  Value B = BroadcastTo(b, Input(ctx, "self", e), out.sizes);
  Value F = ToBatch(b, Input(ctx, "A", e), BatchOf(out.sizes));
  return {Out(b, CholeskySolve(b, F, B, ctx.bool_arg("upper")), out)};
}

// cholesky_inverse(F [*, n, n], upper) = (F F^T)^-1 or (F^T F)^-1
std::vector<Value> LowerCholeskyInverse(LoweringContext& ctx) {
  auto& b = ctx.b;
  const auto& out = ctx.outputs[0];
  const ElementType e = ComputeType(ctx, out.dtype);
  if (AnyEmpty(ctx)) return AllZeros(b, ctx);
  Value F = Input(ctx, "self", e);
  const bool upper = ctx.bool_arg("upper");
  // Only the triangle named by `upper` is read, as LAPACK's potri.
  F = Tri(b, F, !upper);
  Value I = Eye(b, e, F.dims());
  return {Out(b, CholeskySolve(b, F, I, upper), out)};
}

// ---------------------------------------------------------------------------
// LU with partial pivoting
// ---------------------------------------------------------------------------

struct Lu {
  Value lu;     // [B, m, n]: U on and above the diagonal, L's multipliers below
  Value piv;    // [B, k] s32, 1-based (LAPACK ipiv)
  Value info;   // [B] s32
  Value perm;   // [B, m] s32: row i of P^T A is row perm[i] of A
};

// Factors a [B, m, n] (see the file comment for the algorithm).
Lu LuFactor(Builder& b, const Value& a) {
  const int64_t B = a.dims()[0], m = a.dims()[1], n = a.dims()[2], k = std::min(m, n);
  const ElementType e = a.element();
  Value piv0 = Const(b, ElementType::kS32, 0, std::vector<int64_t>{B, k});
  Value info0 = Const(b, ElementType::kS32, 0, std::vector<int64_t>{B});
  Value perm0 = b.Iota(TensorType{ElementType::kS32, {B, m}}, 1);
  if (k == 0 || B == 0) return {a, piv0, info0, perm0};
  Value init[] = {S32(b, 0), a, piv0, info0, perm0};
  auto r = b.While(
      init,
      [&](Builder& bb, std::span<const Value> v) {
        return std::vector<Value>{bb.Compare(v[0], S32(bb, k), CompareDirection::kLT)};
      },
      [&](Builder& bb, std::span<const Value> v) {
        const Value& j = v[0];
        Value x = v[1], piv = v[2], info = v[3], perm = v[4];
        const std::vector<int64_t> d3{B, m, n}, d2{B, m};
        Value z = S32(bb, 0);
        Value rows = bb.Iota(TensorType{ElementType::kS32, d3}, 1);
        Value cols = bb.Iota(TensorType{ElementType::kS32, d3}, 2);
        Value r2 = bb.Iota(TensorType{ElementType::kS32, d2}, 1);
        Value j3 = bb.BroadcastInDim(j, d3, {});
        Value j2 = bb.BroadcastInDim(j, d2, {});
        // Pivot: first row i >= j of largest |x_ij|.
        Value st_col[] = {z, z, j};
        int64_t col_sz[] = {B, m, 1};
        Value col = bb.Reshape(bb.DynamicSlice(x, st_col, col_sz), d2);
        Value below_or_on = bb.Compare(r2, j2, CompareDirection::kGE);
        Value cand = bb.Select(below_or_on, bb.Abs(col), Const(bb, e, -1, d2));
        int64_t over_rows[] = {1};
        Value maxv = ReduceMax(bb, cand, over_rows, false);
        int64_t bd0[] = {0};
        Value is_max = bb.And(below_or_on, bb.Compare(cand, bb.BroadcastInDim(maxv, d2, bd0), CompareDirection::kEQ));
        Value idx = bb.Select(is_max, r2, Const(bb, ElementType::kS32, static_cast<double>(m), d2));
        Value init_m = S32(bb, m);
        Value p = bb.Reduce(std::span(&idx, 1), std::span(&init_m, 1), over_rows,
                            [](Builder& b3, std::span<const Value> q) { return std::vector<Value>{b3.Min(q[0], q[1])}; })[0];
        // NaN column: no row compares equal to the max; keep row j.
        Value jB = bb.BroadcastInDim(j, std::vector<int64_t>{B}, {});
        p = bb.Select(bb.Compare(p, ConstLike(bb, p, static_cast<double>(m)), CompareDirection::kEQ), jB, p);
        // Swap rows j and p.
        Value st_row[] = {z, j, z};
        int64_t row_sz[] = {B, 1, n};
        Value rowj = bb.DynamicSlice(x, st_row, row_sz);  // [B, 1, n]
        Value p3 = bb.BroadcastInDim(p, d3, bd0);
        Value is_p3 = bb.Compare(rows, p3, CompareDirection::kEQ);
        Value rowp = ReduceSum(bb, bb.Select(is_p3, x, ConstLike(bb, x, 0)), over_rows, false);  // [B, n]
        int64_t bd02[] = {0, 2};
        Value rowp3 = bb.BroadcastInDim(rowp, d3, bd02);
        Value rowj3 = bb.BroadcastInDim(bb.Reshape(rowj, std::vector<int64_t>{B, n}), d3, bd02);
        Value is_j3 = bb.Compare(rows, j3, CompareDirection::kEQ);
        x = bb.Select(is_j3, rowp3, bb.Select(is_p3, rowj3, x));
        // Same swap on the permutation.
        Value p2 = bb.BroadcastInDim(p, d2, bd0);
        Value is_p2 = bb.Compare(r2, p2, CompareDirection::kEQ);
        Value is_j2 = bb.Compare(r2, j2, CompareDirection::kEQ);
        Value st_pj[] = {z, j};
        int64_t one_sz[] = {B, 1};
        Value permj = bb.BroadcastInDim(bb.Reshape(bb.DynamicSlice(perm, st_pj, one_sz), std::vector<int64_t>{B}), d2, bd0);
        Value permp = bb.BroadcastInDim(ReduceSum(bb, bb.Select(is_p2, perm, ConstLike(bb, perm, 0)), over_rows, false), d2, bd0);
        perm = bb.Select(is_j2, permp, bb.Select(is_p2, permj, perm));
        // Pivot value and multipliers.
        Value st_d[] = {z, j};
        Value d = bb.Reshape(bb.DynamicSlice(rowp, st_d, one_sz), std::vector<int64_t>{B});
        Value dz = bb.Compare(d, ConstLike(bb, d, 0), CompareDirection::kEQ);
        Value col2 = bb.Reshape(bb.DynamicSlice(x, st_col, col_sz), d2);
        Value below = bb.Compare(r2, j2, CompareDirection::kGT);
        Value scale = bb.And(below, bb.Not(bb.BroadcastInDim(dz, d2, bd0)));
        Value l = bb.Select(scale, bb.Div(col2, bb.BroadcastInDim(d, d2, bd0)), col2);
        int64_t bd01[] = {0, 1};
        Value l3 = bb.BroadcastInDim(l, d3, bd01);
        Value trailing = bb.And(bb.Compare(rows, j3, CompareDirection::kGT), bb.Compare(cols, j3, CompareDirection::kGT));
        x = bb.Select(trailing, bb.Sub(x, bb.Mul(l3, rowp3)), x);
        Value colj_below = bb.And(bb.Compare(rows, j3, CompareDirection::kGT), bb.Compare(cols, j3, CompareDirection::kEQ));
        x = bb.Select(colj_below, l3, x);
        // Record the pivot and info.
        Value p1 = bb.Reshape(bb.Add(p, ConstLike(bb, p, 1)), std::vector<int64_t>{B, 1});
        Value st_piv[] = {z, j};
        piv = bb.DynamicUpdateSlice(piv, p1, st_piv);
        Value first_zero = bb.And(dz, bb.Compare(info, ConstLike(bb, info, 0), CompareDirection::kEQ));
        info = bb.Select(first_zero, bb.Add(jB, ConstLike(bb, jB, 1)), info);
        return std::vector<Value>{bb.Add(j, S32(bb, 1)), x, piv, info, perm};
      });
  return {r[1], r[2], r[3], r[4]};
}

// perm [B, m] from 1-based pivots [B, k]: the row swaps applied in order.
Value PermFromPivots(Builder& b, const Value& piv, int64_t m) {
  const int64_t B = piv.dims()[0], k = piv.dims()[1];
  Value perm0 = b.Iota(TensorType{ElementType::kS32, {B, m}}, 1);
  if (k == 0 || B == 0 || m == 0) return perm0;
  Value init[] = {S32(b, 0), perm0};
  auto r = b.While(
      init,
      [&](Builder& bb, std::span<const Value> v) {
        return std::vector<Value>{bb.Compare(v[0], S32(bb, k), CompareDirection::kLT)};
      },
      [&](Builder& bb, std::span<const Value> v) {
        const Value& j = v[0];
        Value perm = v[1];
        const std::vector<int64_t> d2{B, m};
        Value z = S32(bb, 0);
        Value st[] = {z, j};
        int64_t one_sz[] = {B, 1};
        int64_t bd0[] = {0};
        Value p = bb.Sub(bb.Reshape(bb.DynamicSlice(piv, st, one_sz), std::vector<int64_t>{B}),
                         Const(bb, ElementType::kS32, 1, std::vector<int64_t>{B}));
        Value r2 = bb.Iota(TensorType{ElementType::kS32, d2}, 1);
        Value is_p = bb.Compare(r2, bb.BroadcastInDim(p, d2, bd0), CompareDirection::kEQ);
        Value is_j = bb.Compare(r2, bb.BroadcastInDim(j, d2, {}), CompareDirection::kEQ);
        int64_t over[] = {1};
        Value permj = bb.BroadcastInDim(bb.Reshape(bb.DynamicSlice(perm, st, one_sz), std::vector<int64_t>{B}), d2, bd0);
        Value permp = bb.BroadcastInDim(ReduceSum(bb, bb.Select(is_p, perm, ConstLike(bb, perm, 0)), over, false), d2, bd0);
        perm = bb.Select(is_j, permp, bb.Select(is_p, permj, perm));
        return std::vector<Value>{bb.Add(j, S32(bb, 1)), perm};
      });
  return r[1];
}

// P [B, m, m] with A = P L U: P[r, i] = (r == perm[i]).
Value PermMatrix(Builder& b, const Value& perm, ElementType e) {
  const int64_t B = perm.dims()[0], m = perm.dims()[1];
  std::vector<int64_t> d3{B, m, m};
  int64_t bd02[] = {0, 2};
  Value hit = b.Compare(b.Iota(TensorType{ElementType::kS32, d3}, 1), b.BroadcastInDim(perm, d3, bd02),
                        CompareDirection::kEQ);
  return b.Select(hit, Const(b, e, 1, d3), Const(b, e, 0, d3));
}

// Solves A X = B (adjoint: A^T X = B) given A's LU [B, n, n] and perm [B, n]; rhs [B, n, r].
Value LuSolve(Builder& b, const Value& lu, const Value& perm, const Value& rhs, bool adjoint) {
  if (!adjoint) {
    Value y = GatherRows(b, rhs, perm);                       // P^T B
    y = b.TriangularSolve(lu, y, true, true, true, false);    // L^-1
    return b.TriangularSolve(lu, y, true, false, false, false);  // U^-1
  }
  Value y = b.TriangularSolve(lu, rhs, true, false, false, true);  // U^-T
  y = b.TriangularSolve(lu, y, true, true, true, true);            // L^-T
  return GatherRows(b, y, InversePerm(b, perm));                   // P y
}

// linalg_lu_factor_ex(A [*, m, n], pivot, check_errors) -> (LU, pivots [*, k] int32, info [*] int32)
std::vector<Value> LowerLuFactorEx(LoweringContext& ctx) {
  auto& b = ctx.b;
  if (!ctx.bool_arg("pivot"))
    throw LoweringError(ctx.op_name() + ": LU without pivoting is not implemented on the CPU either");
  if (ctx.bool_arg("check_errors"))
    throw LoweringError(ctx.op_name() + ": check_errors=True raises from the data; runs on the CPU");
  const ElementType e = ComputeType(ctx, ctx.outputs[0].dtype);
  Value A = Input(ctx, "A", e);
  const auto batch = BatchOf(A.dims());
  Lu f = LuFactor(b, Flatten(b, A));
  return {Out(b, Unflatten(b, f.lu, batch), ctx.outputs[0]), Out(b, f.piv, ctx.outputs[1]),
          Out(b, f.info, ctx.outputs[2])};
}

// P, L, U of an LU factorization lu [B, m, n] with row permutation perm.
std::vector<Value> Unpack(Builder& b, const Value& lu, const Value& perm, const std::vector<int64_t>& batch,
                          const LoweringContext& ctx, bool unpack_data, bool unpack_pivots) {
  const int64_t m = Rows(lu), n = Cols(lu), k = std::min(m, n);
  const ElementType e = lu.element();
  std::vector<Value> r;
  r.push_back(unpack_pivots && Numel(ctx.outputs[0].sizes) != 0
                  ? Out(b, Unflatten(b, PermMatrix(b, perm, e), batch), ctx.outputs[0])
                  : Zeros(b, ctx.outputs[0]));
  if (unpack_data && Numel(ctx.outputs[1].sizes) != 0 && Numel(ctx.outputs[2].sizes) != 0) {
    Value L = SliceMatrix(b, lu, 0, m, 0, k);
    L = b.Add(Tri(b, L, true, -1), Eye(b, e, L.dims()));
    Value U = Tri(b, SliceMatrix(b, lu, 0, k, 0, n), false);
    r.push_back(Out(b, Unflatten(b, L, batch), ctx.outputs[1]));
    r.push_back(Out(b, Unflatten(b, U, batch), ctx.outputs[2]));
  } else {
    r.push_back(Zeros(b, ctx.outputs[1]));
    r.push_back(Zeros(b, ctx.outputs[2]));
  }
  return r;
}

// lu_unpack(LU [*, m, n], pivots [*, k], unpack_data, unpack_pivots) -> (P, L, U)
std::vector<Value> LowerLuUnpack(LoweringContext& ctx) {
  auto& b = ctx.b;
  const ElementType e = ComputeType(ctx, ctx.arg("LU_data").dtype);
  Value lu = Input(ctx, "LU_data", e);
  const auto batch = BatchOf(lu.dims());
  Value piv = CastElement(b, ctx.tensor("LU_pivots"), ElementType::kS32);
  if (piv.dims() != With(batch, {std::min(Rows(lu), Cols(lu))}))
    throw LoweringError(ctx.op_name() + ": LU_pivots' shape does not match LU_data's");
  Value lu3 = Flatten(b, lu);
  const bool up = ctx.bool_arg("unpack_pivots");
  Value perm = up ? PermFromPivots(b, Flatten(b, piv, 1), Rows(lu)) : Value{};
  return Unpack(b, lu3, perm, batch, ctx, ctx.bool_arg("unpack_data"), up);
}

// linalg_lu(A [*, m, n], pivot) -> (P, L, U)
std::vector<Value> LowerLinalgLu(LoweringContext& ctx) {
  auto& b = ctx.b;
  if (!ctx.bool_arg("pivot"))
    throw LoweringError(ctx.op_name() + ": LU without pivoting is not implemented on the CPU either");
  const ElementType e = ComputeType(ctx, ctx.outputs[1].dtype);
  Value A = Input(ctx, "A", e);
  const auto batch = BatchOf(A.dims());
  Lu f = LuFactor(b, Flatten(b, A));
  return Unpack(b, f.lu, f.perm, batch, ctx, true, true);
}

// Solves with LU/perm already broadcast to `batch` (flattened [B, n, n] / [B, n]);
// rhs [*batch, n, r]; left/adjoint as linalg_lu_solve.
Value LuSolveGeneral(Builder& b, const Value& lu3, const Value& perm, const Value& rhs, bool left, bool adjoint,
                     const std::vector<int64_t>& batch) {
  if (left) return Unflatten(b, LuSolve(b, lu3, perm, Flatten(b, rhs), adjoint), batch);
  // X A = B  <=>  A^T X^T = B^T ; X A^T = B  <=>  A X^T = B^T (real dtypes).
  Value xt = LuSolve(b, lu3, perm, Flatten(b, MT(b, rhs)), !adjoint);
  return MT(b, Unflatten(b, xt, batch));
}

// linalg_lu_solve(LU [*, n, n], pivots [*, n], B [*, n, k], left, adjoint)
std::vector<Value> LowerLuSolve(LoweringContext& ctx) {
  auto& b = ctx.b;
  const auto& out = ctx.outputs[0];
  const ElementType e = ComputeType(ctx, out.dtype);
  if (AnyEmpty(ctx)) return AllZeros(b, ctx);
  Value lu = Input(ctx, "LU", e), rhs = Input(ctx, "B", e);
  Value piv = CastElement(b, ctx.tensor("pivots"), ElementType::kS32);
  const int64_t n = Rows(lu);
  const auto batch = BatchOf(out.sizes);
  lu = ToBatch(b, lu, batch);
  piv = ToBatch(b, piv, batch, 1);
  rhs = BroadcastTo(b, rhs, out.sizes);
  Value perm = PermFromPivots(b, Flatten(b, piv, 1), n);
  return {Out(b, LuSolveGeneral(b, Flatten(b, lu), perm, rhs, ctx.bool_arg("left"), ctx.bool_arg("adjoint"), batch),
              out)};
}

// _linalg_solve_ex(A [*, n, n], B [*, n, k] or [*, n], left, check_errors)
//   -> (result, LU, pivots, info); LU of A itself, as PyTorch 2.13's CPU kernel.
std::vector<Value> LowerSolveEx(LoweringContext& ctx) {
  auto& b = ctx.b;
  if (ctx.bool_arg("check_errors"))
    throw LoweringError(ctx.op_name() + ": check_errors=True raises from the data; runs on the CPU");
  const auto& out = ctx.outputs[0];
  const ElementType e = ComputeType(ctx, out.dtype);
  Value A = Input(ctx, "A", e);
  const auto abatch = BatchOf(A.dims());
  Lu f = LuFactor(b, Flatten(b, A));
  std::vector<Value> r(4);
  r[1] = Out(b, Unflatten(b, f.lu, abatch), ctx.outputs[1]);
  r[2] = Out(b, f.piv, ctx.outputs[2]);
  r[3] = Out(b, f.info, ctx.outputs[3]);
  if (Numel(out.sizes) == 0) {
    r[0] = Zeros(b, out);
    return r;
  }
  Value rhs = CastElement(b, ctx.tensor("B"), e);
  const bool left = ctx.bool_arg("left");
  const int64_t n = Rows(A);
  // Vector right-hand side (numpy): B.dim() == 1, or B's shape is A's without the last dim.
  const bool vector_case = rhs.rank() == 1 || (rhs.rank() == A.rank() - 1 &&
                                               std::equal(rhs.dims().begin(), rhs.dims().end(), A.dims().begin()));
  std::vector<int64_t> mat_sizes = out.sizes;
  if (vector_case) mat_sizes.push_back(1);
  if (vector_case) rhs = b.Reshape(rhs, With(rhs.dims(), {1}));
  const auto batch = BatchOf(mat_sizes);
  rhs = BroadcastTo(b, rhs, mat_sizes);
  Value lu3 = Flatten(b, ToBatch(b, Unflatten(b, f.lu, abatch), batch));
  Value perm = Flatten(b, ToBatch(b, Unflatten(b, f.perm, abatch), batch, 1), 1);
  (void)n;
  Value X = LuSolveGeneral(b, lu3, perm, rhs, left, false, batch);
  r[0] = Out(b, X, out);
  return r;
}

// Sign of the permutation from 1-based pivots [B, k]: (-1)^(number of swaps).
Value PivotSign(Builder& b, const Value& piv, ElementType e) {
  const int64_t B = piv.dims()[0], k = piv.dims()[1];
  Value pos = b.Add(b.Iota(TensorType{ElementType::kS32, piv.dims()}, 1), Const(b, ElementType::kS32, 1, piv.dims()));
  Value swapped = b.Convert(b.Compare(piv, pos, CompareDirection::kNE), ElementType::kS32);
  int64_t over[] = {1};
  Value count = ReduceSum(b, swapped, over, false);
  Value odd = b.Compare(b.Rem(count, Const(b, ElementType::kS32, 2, std::vector<int64_t>{B})),
                        Const(b, ElementType::kS32, 0, std::vector<int64_t>{B}), CompareDirection::kNE);
  (void)k;
  return b.Select(odd, Const(b, e, -1, std::vector<int64_t>{B}), Const(b, e, 1, std::vector<int64_t>{B}));
}

// _linalg_det(A [*, n, n]) -> (det, LU, pivots); LU of A^T for a contiguous A
// (det(A^T) = det(A)), as CPU, whose backward formula reads LU that way.
std::vector<Value> LowerDet(LoweringContext& ctx) {
  auto& b = ctx.b;
  const ElementType e = ComputeType(ctx, ctx.outputs[0].dtype);
  Value A = Input(ctx, "A", e);
  const auto batch = BatchOf(A.dims());
  Lu f = LuFactor(b, Flatten(b, ctx.arg("A").contiguous ? MT(b, A) : A));
  int64_t over[] = {1};
  Value det = b.Mul(PivotSign(b, f.piv, e), ReduceProd(b, Diagonal(b, f.lu), over, false));
  return {Out(b, det, ctx.outputs[0]), Out(b, Unflatten(b, f.lu, batch), ctx.outputs[1]),
          Out(b, f.piv, ctx.outputs[2])};
}

// _linalg_slogdet(A [*, n, n]) -> (sign, logabsdet, LU, pivots); LU as _linalg_det's.
std::vector<Value> LowerSlogdet(LoweringContext& ctx) {
  auto& b = ctx.b;
  const ElementType e = ComputeType(ctx, ctx.outputs[1].dtype);
  Value A = Input(ctx, "A", e);
  const auto batch = BatchOf(A.dims());
  Lu f = LuFactor(b, Flatten(b, ctx.arg("A").contiguous ? MT(b, A) : A));
  Value d = Diagonal(b, f.lu);
  int64_t over[] = {1};
  Value diag_sign = ReduceProd(b, b.Unary("stablehlo.sign", d), over, false);
  Value sign = b.Mul(PivotSign(b, f.piv, e), diag_sign);
  Value logabs = ReduceSum(b, b.Log(b.Abs(d)), over, false);
  return {Out(b, sign, ctx.outputs[0]), Out(b, logabs, ctx.outputs[1]),
          Out(b, Unflatten(b, f.lu, batch), ctx.outputs[2]), Out(b, f.piv, ctx.outputs[3])};
}

// linalg_inv_ex(A [*, n, n], check_errors) -> (inverse, info)
std::vector<Value> LowerInvEx(LoweringContext& ctx) {
  auto& b = ctx.b;
  if (ctx.bool_arg("check_errors"))
    throw LoweringError(ctx.op_name() + ": check_errors=True raises from the data; runs on the CPU");
  const ElementType e = ComputeType(ctx, ctx.outputs[0].dtype);
  if (AnyEmpty(ctx)) return AllZeros(b, ctx);
  Value A = Input(ctx, "A", e);
  const auto batch = BatchOf(A.dims());
  Lu f = LuFactor(b, Flatten(b, A));
  Value I = Eye(b, e, f.lu.dims());
  Value X = LuSolve(b, f.lu, f.perm, I, false);
  return {Out(b, Unflatten(b, X, batch), ctx.outputs[0]), Out(b, f.info, ctx.outputs[1])};
}

// ---------------------------------------------------------------------------
// QR (XLA's Householder expanders)
// ---------------------------------------------------------------------------

// geqrf of a [B, m, n]: (a with R on/above the diagonal and the reflectors
// below, tau [B, min(m, n)]), LAPACK's format.
std::pair<Value, Value> Geqrf(Builder& b, const Value& a) {
  const int64_t B = a.dims()[0], m = a.dims()[1], n = a.dims()[2];
  TensorType types[] = {a.type, TensorType{a.element(), {B, std::min(m, n)}}};
  Value in[] = {a};
  auto r = b.CustomCall("Qr", in, types);
  return {r[0], r[1]};
}

// Q = H_1 ... H_k [B, m, n] from reflectors a [B, m, n] and tau [B, k] (LAPACK orgqr).
Value HouseholderProduct(Builder& b, const Value& a, const Value& tau) {
  Value in[] = {a, tau};
  TensorType types[] = {a.type};
  return b.CustomCall("ProductOfElementaryHouseholderReflectors", in, types)[0];
}

// geqrf(A [*, m, n]) -> (a, tau [*, min(m, n)])
std::vector<Value> LowerGeqrf(LoweringContext& ctx) {
  auto& b = ctx.b;
  const ElementType e = ComputeType(ctx, ctx.outputs[0].dtype);
  if (AnyEmpty(ctx)) {
    std::vector<Value> r = AllZeros(b, ctx);
    if (Numel(ctx.outputs[0].sizes) != 0) r[0] = Out(b, Input(ctx, "self", e), ctx.outputs[0]);
    return r;
  }
  Value A = Input(ctx, "self", e);
  const auto batch = BatchOf(A.dims());
  auto [a, tau] = Geqrf(b, Flatten(b, A));
  return {Out(b, Unflatten(b, a, batch), ctx.outputs[0]), Out(b, Unflatten(b, tau, batch), ctx.outputs[1])};
}

// linalg_householder_product / orgqr(input [*, m, n], tau [*, k]) -> Q [*, m, n]
std::vector<Value> LowerHouseholderProduct(LoweringContext& ctx) {
  auto& b = ctx.b;
  const auto& out = ctx.outputs[0];
  const ElementType e = ComputeType(ctx, out.dtype);
  const bool orgqr = ctx.find("input") == nullptr;
  Value A = Input(ctx, orgqr ? "self" : "input", e);
  Value tau = CastElement(b, ctx.tensor(orgqr ? "input2" : "tau"), e);
  const int64_t m = Rows(A), n = Cols(A), k = tau.dims().empty() ? 0 : tau.dims().back();
  if (!(m >= n && n >= k))
    throw LoweringError(ctx.op_name() + ": needs input.shape[-2] >= input.shape[-1] >= tau.shape[-1]");
  if (AnyEmpty(ctx)) return AllZeros(b, ctx);
  const auto batch = BatchOf(A.dims());
  if (BatchOf(tau.dims(), 1) != batch) throw LoweringError(ctx.op_name() + ": batch dims of input and tau differ");
  if (k == 0) return {Out(b, Unflatten(b, Eye(b, e, Flatten(b, A).dims()), batch), out)};
  Value a3 = Flatten(b, A), t2 = Flatten(b, tau, 1);
  if (k < n) {
    int64_t low[] = {0, 0}, high[] = {0, n - k}, interior[] = {0, 0};
    t2 = b.Pad(t2, Const(b, e, 0), low, high, interior);
  }
  return {Out(b, Unflatten(b, HouseholderProduct(b, a3, t2), batch), out)};
}

// ormqr(a [*, q, k], tau [*, k], C [*, mc, nc], left, transpose): op(Q) C or C op(Q)
std::vector<Value> LowerOrmqr(LoweringContext& ctx) {
  auto& b = ctx.b;
  const auto& out = ctx.outputs[0];
  const ElementType e = ComputeType(ctx, out.dtype);
  if (AnyEmpty(ctx)) return AllZeros(b, ctx);
  Value A = Input(ctx, "self", e), C = Input(ctx, "input3", e);
  Value tau = CastElement(b, ctx.tensor("input2"), e);
  const bool left = ctx.bool_arg("left"), transpose = ctx.bool_arg("transpose");
  const auto batch = BatchOf(C.dims());
  const int64_t q = left ? Rows(C) : Cols(C);
  if (Rows(A) != q) throw LoweringError(ctx.op_name() + ": input.shape[-2] must match other's size on the Q side");
  Value a3 = Flatten(b, ToBatch(b, A, batch)), t2 = Flatten(b, ToBatch(b, tau, batch, 1), 1);
  Value Q;
  if (tau.dims().back() == 0) {
    Q = Eye(b, e, std::vector<int64_t>{a3.dims()[0], q, q});
  } else {
    Value ap = PadMatrix(b, SliceMatrix(b, a3, 0, q, 0, std::min(q, Cols(a3))), q, q);
    const int64_t k = std::min(q, t2.dims()[1]);
    int64_t start[] = {0, 0}, limit[] = {t2.dims()[0], k}, strides[] = {1, 1};
    Value tk = b.Slice(t2, start, limit, strides);
    int64_t low[] = {0, 0}, high[] = {0, q - k}, interior[] = {0, 0};
    Q = HouseholderProduct(b, ap, b.Pad(tk, Const(b, e, 0), low, high, interior));
  }
  if (transpose) Q = MT(b, Q);
  Value c3 = Flatten(b, C);
  Value r = left ? MatMul(b, Q, c3) : MatMul(b, c3, Q);
  return {Out(b, Unflatten(b, r, batch), out)};
}

// linalg_qr(A [*, m, n], mode) -> (Q, R): reduced Q [m, k] R [k, n]; complete
// Q [m, m] R [m, n]; "r": Q empty, R [k, n].
std::vector<Value> LowerLinalgQr(LoweringContext& ctx) {
  auto& b = ctx.b;
  const ElementType e = ComputeType(ctx, ctx.outputs[1].dtype);
  const std::string mode(ctx.string_arg("mode"));
  if (mode != "reduced" && mode != "complete" && mode != "r")
    throw LoweringError(ctx.op_name() + ": unknown mode '" + mode + "'");
  Value A = Input(ctx, "A", e);
  const auto batch = BatchOf(A.dims());
  const int64_t m = Rows(A), n = Cols(A), k = std::min(m, n);
  if (Numel(batch) == 0 || m == 0 || n == 0) {
    std::vector<Value> r = AllZeros(b, ctx);
    if (mode == "complete" && Numel(ctx.outputs[0].sizes) != 0)
      r[0] = Out(b, Eye(b, e, ctx.outputs[0].sizes), ctx.outputs[0]);
    return r;
  }
  auto [a, tau] = Geqrf(b, Flatten(b, A));
  const int64_t rr = mode == "complete" ? m : k;
  Value R = Tri(b, SliceMatrix(b, a, 0, std::min(rr, m), 0, n), false);
  std::vector<Value> r(2);
  r[1] = Out(b, Unflatten(b, R, batch), ctx.outputs[1]);
  if (mode == "r") {
    r[0] = Zeros(b, ctx.outputs[0]);
  } else if (mode == "complete" && m > n) {
    Value ap = PadMatrix(b, a, m, m);
    int64_t low[] = {0, 0}, high[] = {0, m - k}, interior[] = {0, 0};
    Value tp = b.Pad(tau, Const(b, e, 0), low, high, interior);
    r[0] = Out(b, Unflatten(b, HouseholderProduct(b, ap, tp), batch), ctx.outputs[0]);
  } else {
    r[0] = Out(b, Unflatten(b, HouseholderProduct(b, SliceMatrix(b, a, 0, m, 0, k), tau), batch), ctx.outputs[0]);
  }
  return r;
}

// ---------------------------------------------------------------------------
// Symmetric eigendecomposition and SVD
// ---------------------------------------------------------------------------

// _linalg_eigh(A [*, n, n], UPLO, compute_v) -> (eigenvalues [*, n] ascending, eigenvectors [*, n, n])
std::vector<Value> LowerEigh(LoweringContext& ctx) {
  auto& b = ctx.b;
  const ElementType e = ComputeType(ctx, ctx.outputs[0].dtype);
  const std::string uplo(ctx.string_arg("UPLO"));
  if (uplo != "L" && uplo != "U" && uplo != "l" && uplo != "u")
    throw LoweringError(ctx.op_name() + ": UPLO must be 'L' or 'U', got '" + uplo + "'");
  if (AnyEmpty(ctx) && Numel(ctx.outputs[0].sizes) == 0) return AllZeros(b, ctx);
  Value A = Input(ctx, "A", e);
  const auto batch = BatchOf(A.dims());
  const int64_t n = Rows(A);
  Value a3 = Flatten(b, A);
  const int64_t B = a3.dims()[0];
  const bool lower = uplo == "L" || uplo == "l";
  // backend_config: lower, sort_eigenvalues, max sweeps, tolerance (XLA's EighExpander).
  const double tol = e == ElementType::kF32 ? 1e-7 : 1e-15;
  char config[64];
  std::snprintf(config, sizeof(config), "%d,1,%d,%g", lower ? 1 : 0, static_cast<int>(kMaxSweeps), tol);
  TensorType types[] = {a3.type, TensorType{e, {B, n}}};
  Value in[] = {a3};
  auto r = b.CustomCall("Eigh", in, types, config);
  std::vector<Value> res{Out(b, Unflatten(b, r[1], batch), ctx.outputs[0])};
  res.push_back(Numel(ctx.outputs[1].sizes) != 0 ? Out(b, Unflatten(b, r[0], batch), ctx.outputs[1])
                                                  : Zeros(b, ctx.outputs[1]));
  return res;
}

// Columns of x [B, r, c] picked by idx [B, c'] (s32).
Value GatherCols(Builder& b, const Value& x, const Value& idx) {
  std::vector<int64_t> perm{0, 2, 1};
  return b.Transpose(GatherRows(b, b.Transpose(x, perm), idx), perm);
}

// One-sided Jacobi SVD of a [B, m, n], m >= n >= 1 (see the file comment).
// Returns (U [B, m, n] = G diag(1/sigma), sigma [B, n] descending, V [B, n, n]).
struct Svd {
  Value u, s, v;
};
Svd JacobiSvd(Builder& b, const Value& a) {
  const int64_t B = a.dims()[0], m = a.dims()[1], n = a.dims()[2];
  const ElementType e = a.element();
  const int64_t N = n + (n % 2), h = N / 2;
  const double eps = e == ElementType::kF32 ? std::numeric_limits<float>::epsilon()
                                            : std::numeric_limits<double>::epsilon();
  const double tol = eps * std::max(1.0, std::sqrt(static_cast<double>(m)));
  Value G = PadMatrix(b, a, m, N);
  Value V = Eye(b, e, std::vector<int64_t>{B, N, N});
  const std::vector<int64_t> dh{B, h};
  int64_t over_rows[] = {1};
  int64_t bd02[] = {0, 2};

  // One tournament step on X = [top | bottom] columns with rotations (c, s) [B, h].
  auto rotate = [&](Builder& bb, const Value& X, const Value& c, const Value& s) {
    const int64_t r = X.dims()[1];
    Value top = SliceMatrix(bb, X, 0, r, 0, h), bot = SliceMatrix(bb, X, 0, r, h, N);
    std::vector<int64_t> d3{B, r, h};
    Value c3 = bb.BroadcastInDim(c, d3, bd02), s3 = bb.BroadcastInDim(s, d3, bd02);
    Value nt = bb.Sub(bb.Mul(c3, top), bb.Mul(s3, bot));
    Value nb = bb.Add(bb.Mul(s3, top), bb.Mul(c3, bot));
    // Round-robin move: top' = [t0, b0, t1 .. t_{h-2}], bottom' = [b1 .. b_{h-1}, t_{h-1}].
    if (h == 1) return bb.Concatenate(std::vector<Value>{nt, nb}, 2);
    std::vector<Value> parts{SliceMatrix(bb, nt, 0, r, 0, 1), SliceMatrix(bb, nb, 0, r, 0, 1)};
    if (h > 2) parts.push_back(SliceMatrix(bb, nt, 0, r, 1, h - 1));
    parts.push_back(SliceMatrix(bb, nb, 0, r, 1, h));
    parts.push_back(SliceMatrix(bb, nt, 0, r, h - 1, h));
    return bb.Concatenate(parts, 2);
  };

  auto step = [&](Builder& bb, const Value& g, const Value& v, const Value& maxoff) {
    Value top = SliceMatrix(bb, g, 0, m, 0, h), bot = SliceMatrix(bb, g, 0, m, h, N);
    Value alpha = ReduceSum(bb, bb.Mul(top, top), over_rows, false);
    Value beta = ReduceSum(bb, bb.Mul(bot, bot), over_rows, false);
    Value gamma = ReduceSum(bb, bb.Mul(top, bot), over_rows, false);
    Value zero = Const(bb, e, 0, dh), one = Const(bb, e, 1, dh);
    Value norm = bb.Sqrt(bb.Mul(alpha, beta));
    Value rel = bb.Div(bb.Abs(gamma), norm);
    Value active = bb.And(bb.Compare(gamma, zero, CompareDirection::kNE),
                          bb.Compare(rel, Const(bb, e, tol, dh), CompareDirection::kGT));
    Value zeta = bb.Div(bb.Sub(beta, alpha), bb.Mul(Const(bb, e, 2, dh), gamma));
    Value sgn = bb.Select(bb.Compare(zeta, zero, CompareDirection::kGE), one, bb.Neg(one));
    Value t = bb.Div(sgn, bb.Add(bb.Abs(zeta), bb.Sqrt(bb.Add(one, bb.Mul(zeta, zeta)))));
    Value c = bb.Rsqrt(bb.Add(one, bb.Mul(t, t)));
    Value s = bb.Mul(c, t);
    c = bb.Select(active, c, one);
    s = bb.Select(active, s, zero);
    Value relv = bb.Select(active, rel, zero);
    int64_t over_pairs[] = {0, 1};
    Value m_off = MaxPropagateNaN(bb, maxoff, ReduceMax(bb, relv, over_pairs, false));
    return std::vector<Value>{rotate(bb, g, c, s), rotate(bb, v, c, s), m_off};
  };

  Value zero_s = Const(b, e, 0);
  Value init[] = {S32(b, 0), b.Constant(TensorType{ElementType::kPred, {}}, 0), G, V};
  auto outer = b.While(
      init,
      [&](Builder& bb, std::span<const Value> v) {
        Value more = bb.Compare(v[0], S32(bb, kMaxSweeps), CompareDirection::kLT);
        return std::vector<Value>{bb.And(more, bb.Not(v[1]))};
      },
      [&](Builder& bb, std::span<const Value> v) {
        Value inner_init[] = {S32(bb, 0), v[2], v[3], Const(bb, e, 0)};
        auto inner = bb.While(
            inner_init,
            [&](Builder& b2, std::span<const Value> w) {
              return std::vector<Value>{b2.Compare(w[0], S32(b2, N - 1), CompareDirection::kLT)};
            },
            [&](Builder& b2, std::span<const Value> w) {
              auto r = step(b2, w[1], w[2], w[3]);
              return std::vector<Value>{b2.Add(w[0], S32(b2, 1)), r[0], r[1], r[2]};
            });
        // Converged: no pair of this sweep was rotated (NaN never converges).
        Value conv = bb.Compare(inner[3], Const(bb, e, tol), CompareDirection::kLE);
        return std::vector<Value>{bb.Add(v[0], S32(bb, 1)), conv, inner[1], inner[2]};
      });
  (void)zero_s;
  G = outer[2];
  V = outer[3];
  // A full sweep returns the columns to their starting places: the padding column is last.
  int64_t over_r[] = {1};
  Value sigma = b.Sqrt(ReduceSum(b, b.Mul(G, G), over_r, false));  // [B, N]
  Value key = sigma;
  if (N != n) {
    Value is_pad = b.Compare(b.Iota(TensorType{ElementType::kS32, {B, N}}, 1),
                             Const(b, ElementType::kS32, static_cast<double>(n), std::vector<int64_t>{B, N}),
                             CompareDirection::kGE);
    key = b.Select(is_pad, Const(b, e, -1, std::vector<int64_t>{B, N}), sigma);
  }
  Value idx = b.Iota(TensorType{ElementType::kS32, {B, N}}, 1);
  Value sort_in[] = {key, idx};
  auto sorted = b.Sort(sort_in, 1, true, [](Builder& bb, std::span<const Value> q) {
    return std::vector<Value>{bb.Compare(q[0], q[1], CompareDirection::kGT)};
  });
  int64_t s0[] = {0, 0}, s1[] = {B, n}, st[] = {1, 1};
  Value order = b.Slice(sorted[1], s0, s1, st);                      // [B, n]
  Value sig = b.Slice(sorted[0], s0, s1, st);
  int64_t bd01[] = {0, 2};
  Value pos = b.Compare(sigma, ConstLike(b, sigma, 0), CompareDirection::kGT);
  Value inv_sigma = b.Select(pos, b.Div(ConstLike(b, sigma, 1), sigma), ConstLike(b, sigma, 0));
  Value U = b.Mul(G, b.BroadcastInDim(inv_sigma, G.dims(), bd01));
  U = GatherCols(b, U, order);                                       // [B, m, n]
  Value Vs = SliceMatrix(b, GatherCols(b, V, order), 0, n, 0, n);    // [B, n, n]
  return {U, sig, Vs};
}

// _linalg_svd(A [*, m, n], full_matrices, compute_uv, driver)
//   -> (U [*, m, m or k], S [*, k] descending, Vh [*, n or k, n]); U/Vh empty without compute_uv.
std::vector<Value> LowerSvd(LoweringContext& ctx) {
  auto& b = ctx.b;
  const ElementType e = ComputeType(ctx, ctx.outputs[1].dtype);
  const bool full = ctx.bool_arg("full_matrices"), uv = ctx.bool_arg("compute_uv");
  Value A = Input(ctx, "A", e);
  const auto batch = BatchOf(A.dims());
  const int64_t m = Rows(A), n = Cols(A), k = std::min(m, n);
  if (Numel(batch) == 0 || k == 0) {
    std::vector<Value> r = AllZeros(b, ctx);
    for (int i : {0, 2})
      if (Numel(ctx.outputs[static_cast<size_t>(i)].sizes) != 0)
        r[static_cast<size_t>(i)] = Eye(b, e, ctx.outputs[static_cast<size_t>(i)].sizes);
    return r;
  }
  const bool wide = m < n;
  Value a3 = Flatten(b, wide ? MT(b, A) : A);  // [B, M, k], M >= k
  const int64_t M = a3.dims()[1];
  Svd s = JacobiSvd(b, a3);
  std::vector<Value> r(3);
  r[1] = Out(b, Unflatten(b, s.s, batch), ctx.outputs[1]);
  if (!uv) {
    r[0] = Zeros(b, ctx.outputs[0]);
    r[2] = Zeros(b, ctx.outputs[2]);
    return r;
  }
  // Orthonormal (and, for full_matrices, completed) U from a Householder QR of U.
  auto [qa, tau] = Geqrf(b, s.u);
  Value d = Diagonal(b, qa);  // R's diagonal [B, k]
  Value dsign = b.Select(b.Compare(d, ConstLike(b, d, 0), CompareDirection::kLT), ConstLike(b, d, -1),
                         ConstLike(b, d, 1));
  Value Q;
  const int64_t B = a3.dims()[0];
  if (full && M > k) {
    int64_t low[] = {0, 0}, high[] = {0, M - k}, interior[] = {0, 0};
    Q = HouseholderProduct(b, PadMatrix(b, qa, M, M), b.Pad(tau, Const(b, e, 0), low, high, interior));
    dsign = b.Pad(dsign, Const(b, e, 1), low, high, interior);
  } else {
    Q = HouseholderProduct(b, qa, tau);
  }
  int64_t bd02[] = {0, 2};
  Value U = b.Mul(Q, b.BroadcastInDim(dsign, Q.dims(), bd02));  // [B, M, M or k]
  Value Vh = MT(b, s.v);                                         // [B, k, k]
  (void)B;
  if (!wide) {
    r[0] = Out(b, Unflatten(b, U, batch), ctx.outputs[0]);
    r[2] = Out(b, Unflatten(b, Vh, batch), ctx.outputs[2]);
  } else {
    // A^T = U' S V'^T  =>  A = V' S U'^T.
    r[0] = Out(b, Unflatten(b, s.v, batch), ctx.outputs[0]);
    r[2] = Out(b, Unflatten(b, MT(b, U), batch), ctx.outputs[2]);
  }
  return r;
}


}  // namespace

TORCH_TPU_LOWERINGS({
    {"linalg_solve_triangular", LowerSolveTriangular},
    {"triangular_solve", LowerTriangularSolve},
    {"linalg_cholesky_ex", LowerCholeskyEx},
    {"cholesky", LowerCholesky},
    {"_cholesky_solve_helper", LowerCholeskySolveHelper},
    {"cholesky_inverse", LowerCholeskyInverse},
    {"linalg_lu_factor_ex", LowerLuFactorEx},
    {"lu_unpack", LowerLuUnpack},
    {"linalg_lu", LowerLinalgLu},
    {"linalg_lu_solve", LowerLuSolve},
    {"_linalg_solve_ex", LowerSolveEx},
    {"_linalg_det", LowerDet},
    {"_linalg_slogdet", LowerSlogdet},
    {"linalg_inv_ex", LowerInvEx},
    {"geqrf", LowerGeqrf},
    {"linalg_householder_product", LowerHouseholderProduct},
    {"orgqr", LowerHouseholderProduct},
    {"ormqr", LowerOrmqr},
    {"linalg_qr", LowerLinalgQr},
    {"_linalg_eigh", LowerEigh},
    {"_linalg_svd", LowerSvd},
});

}  // namespace torch_tpu::lowering
