// The decode driver: a step's decodes (and a cascade's groups) cut into jobs,
// pieces and tasks for the threads, then merged (run).
//
// Part of paged_decode.cpp, the one translation unit that includes it: the
// unnamed namespace gives its code the internal linkage it had as one file.
#pragma once

#include "rows.h"

namespace {

// A step's decode work, cut into tasks for the threads. A *job* is a set of
// query rows (those of its member sequences) attending over one run of keys
// of its first member's context: a sequence's own context, a group's shared
// prefix, or a group member's own suffix. A job is cut into *pieces* along
// its keys so that every core has work even with one sequence or one group;
// a task is one (piece, KV head), and a thread runs a piece's tasks
// together. Pieces write softmax states that a second pass merges per
// sequence, except a sequence alone in one piece, which writes its output
// directly (the common ungrouped case costs no merge).
struct Job {
  int64_t member0, members;  // its sequences: member_list[member0 : member0 + members]
  int64_t begin, end;        // the key run, as indices into member0's context
  // Deterministic mode: the job (a group's prefix) whose softmax state this
  // one's rows go on from, at its row resume_row; -1: none.
  int64_t resume_job = -1, resume_row = 0;
};
struct Piece {
  int64_t job, begin, end;
  int64_t state;  // offset of its KV head 0 state block in `states`; -1: writes the output
};
struct Source {  // where one sequence finds part of its softmax
  int64_t piece, row0;  // its first query row among the piece's rows
};

// Per-key cost of reading one K and one V row from memory, in units of one
// query row's arithmetic on that key: it weighs jobs when cutting them.
constexpr int64_t kKeyCost = 8;
// Pieces aim at this many per thread (balance under noisy neighbours)...
constexpr int64_t kTasksPerThread = 4;
// ...but are never shorter than this many keys (each piece costs a merge)...
constexpr int64_t kMinPiece = 32;
// ...and keep the per-key path's [rows, keys] score table within this many
// floats (L2).
constexpr int64_t kMaxScores = 1 << 16;

// Groups of a call: of[b] the group of sequence b (-1: none), prefix[g] how
// many leading context rows group g's members share.
struct Groups {
  const int64_t* of = nullptr;
  const int64_t* prefix = nullptr;
  int64_t count = 0;
};

// Runs task(i, scratch) for i = 0..n-1, every thread taking the next task
// not yet taken (callers put the costliest first): a core slowed by other
// work simply takes fewer.
template <typename F>
void run_tasks(int64_t n, F&& task) {
  std::atomic<int64_t> next{0};
  at::parallel_for(0, std::max<int64_t>(1, at::get_num_threads()), 1, [&](int64_t, int64_t) {
    Scratch s;
    for (int64_t i; (i = next.fetch_add(1)) < n;) task(i, s);
  });
}

// Whether a deterministic decode can resume a softmax state (attend_rows'
// `resume`): the tiled path, or the AMX one where it takes the rows instead,
// takes every row there; the per-key path has no tiles to go on from.
static_assert(kAlignKeys % kAmxKeys == 0, "a group prefix must end at an AMX step boundary");

template <typename T, typename Q>
bool can_resume(int64_t dim) {
  bool ok = false;
  dispatch_dim(dim, [&](auto nv) { ok = RowPaths<T, Q, decltype(nv)::value>::tiled; });
  return ok;
}

template <typename T, typename Q>
void run(const at::Tensor& q, at::Tensor& out, const at::Tensor& k_rows,
         const at::Tensor& v_rows, const at::Tensor& addr, const at::Tensor& offsets,
         const Groups& groups, double scale, double softcap, int64_t window, bool det) {
  const int64_t batch = q.size(0), heads = q.size(1), dim = q.size(2);
  const KVTable table = kv_table(k_rows, dim);
  const int64_t kv_heads = table.kv_heads, qpk = heads / kv_heads;
  const int64_t row_stride = table.row, head_stride = table.head;
  const Q* qp = q.data_ptr<Q>();
  Q* op = out.data_ptr<Q>();
  const T* kp = k_rows.data_ptr<T>();
  const T* vp = v_rows.data_ptr<T>();
  const int64_t* ap = addr.data_ptr<int64_t>();
  const int64_t* offs = offsets.data_ptr<int64_t>();
  const float sc = static_cast<float>(scale), cap = static_cast<float>(softcap);
  // Deterministic mode groups only where a member's softmax can go on from
  // its group's prefix state (resume, below): two states merged by
  // log-sum-exp round differently from one pass over both key runs.
  const bool grouping = groups.count > 0 && (!det || can_resume<T, Q>(dim));
  const int64_t *group_of = grouping ? groups.of : nullptr, *group_prefix = groups.prefix;
  const int64_t num_groups = grouping ? groups.count : 0;

  // Oldest key each sequence sees: positions are consecutive and the newest
  // key is the query's own, so a sliding window keeps the last `window` keys.
  std::vector<int64_t> lo(batch);
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t len = offs[b + 1] - offs[b];
    lo[b] = window > 0 ? std::max<int64_t>(0, len - window) : 0;
  }

  // ---- jobs --------------------------------------------------------------------------
  std::vector<int64_t> member_list;
  std::vector<Job> jobs;
  std::vector<int64_t> prefix_job(num_groups, -1), prefix_end(num_groups);
  if (num_groups > 0) {
    std::vector<std::vector<int64_t>> members(num_groups);
    for (int64_t b = 0; b < batch; ++b)
      if (group_of[b] >= 0) members[group_of[b]].push_back(b);
    for (int64_t g = 0; g < num_groups; ++g) {
      if (members[g].empty()) continue;
      // Keys of the prefix that some member sees (windows cut each differently).
      int64_t begin = group_prefix[g], end = group_prefix[g];
      for (int64_t b : members[g]) begin = std::min(begin, lo[b]);
      if (det) {
        // Members resume the prefix's state, so it ends at an absolute tile
        // boundary and starts where each member's one pass would: the tiles
        // are then those of one pass over each member's whole context.
        end = end / kAlignKeys * kAlignKeys;
        begin = aligned_begin(begin, true);
        bool same = true;
        for (int64_t b : members[g]) same &= aligned_begin(lo[b], true) == begin;
        if (!same) continue;
      }
      if (begin >= end) continue;
      prefix_job[g] = static_cast<int64_t>(jobs.size());
      prefix_end[g] = end;
      jobs.push_back({static_cast<int64_t>(member_list.size()),
                      static_cast<int64_t>(members[g].size()), begin, end});
      member_list.insert(member_list.end(), members[g].begin(), members[g].end());
    }
  }
  // Jobs before own_jobs0 are group prefixes; in deterministic mode every
  // member of one resumes its state.
  const int64_t own_jobs0 = static_cast<int64_t>(jobs.size());
  const bool resumes = det && own_jobs0 > 0;
  std::vector<int64_t> own_job(batch);
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t g = group_of ? group_of[b] : -1;
    const int64_t pj = g >= 0 ? prefix_job[g] : -1;
    own_job[b] = static_cast<int64_t>(jobs.size());
    // After its group's prefix (in deterministic mode every member's window
    // starts inside it), else from the first key it sees.
    Job own{static_cast<int64_t>(member_list.size()), 1,
            pj >= 0 ? std::max(prefix_end[g], lo[b]) : aligned_begin(lo[b], det),
            offs[b + 1] - offs[b]};
    if (det && pj >= 0) {
      const Job& prefix = jobs[pj];
      const int64_t* mem = member_list.data() + prefix.member0;
      own.resume_job = pj;
      own.resume_row = (std::find(mem, mem + prefix.members, b) - mem) * qpk;
    }
    jobs.push_back(own);
    member_list.push_back(b);
  }

  // ---- pieces ------------------------------------------------------------------------
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  int64_t total = 0;
  for (const Job& j : jobs) total += (j.end - j.begin) * (j.members * qpk + kKeyCost);
  const int64_t target = std::max<int64_t>(1, total / (kTasksPerThread * threads));
  std::vector<Piece> pieces;
  std::vector<int64_t> first_piece(jobs.size() + 1);
  int64_t state_size = 0;
  for (size_t i = 0; i < jobs.size(); ++i) {
    const Job& j = jobs[i];
    first_piece[i] = static_cast<int64_t>(pieces.size());
    const int64_t len = j.end - j.begin, rows = j.members * qpk;
    // No keys of its own (deterministic mode: a context that ends where its
    // group's prefix state does): the prefix state alone, merged below.
    if (len <= 0) continue;
    int64_t n = (len * (rows + kKeyCost) + target - 1) / target;
    n = std::min(n, (len + kMinPiece - 1) / kMinPiece);
    n = std::max({n, (rows * len + kMaxScores - 1) / kMaxScores, int64_t{1}});
    // A group's prefix on the tiled (or AMX) path is cut into at most one
    // piece per thread: each piece pays the queries' transposition, the tile
    // set-up and a merge per member row, which pieces of a few hundred keys
    // do not earn back (SmolLM2's shapes over 1,000 shared + 100 own keys,
    // 30 layers, the AMX host: 16 sequences in one group 8.7-9.5 -> 7.1-7.2
    // ms a step, 8 in one 4.6-5.3 -> 3.5-3.8, 4 in one 3.4-3.5 -> 2.6-3.0;
    // groups already in two pieces unchanged). Own runs keep their pieces:
    // cutting every job into one piece per thread cost random prompts 5% of
    // their throughput served (a descheduled thread's share waits for it).
#ifdef RADIXMUX_KEY_VECTORS  // (without vector paths every row goes per key)
    if (static_cast<int64_t>(i) < own_jobs0 && rows >= kTiledRows) n = std::min(n, threads);
#endif
    if (det) n = 1;  // pieces merge by log-sum-exp: another rounding
    // A sequence's own job, whole, needs no merge unless a prefix state joins it
    // (in deterministic mode, it resumes that state instead).
    const bool direct = static_cast<int64_t>(i) >= own_jobs0 && n == 1 &&
                        (det || !group_of || group_of[member_list[j.member0]] < 0);
    for (int64_t p = 0; p < n; ++p) {
      pieces.push_back({static_cast<int64_t>(i), j.begin + len * p / n,
                        j.begin + len * (p + 1) / n, direct ? -1 : state_size});
      if (!direct) state_size += kv_heads * rows * (dim + 2);
    }
  }
  first_piece[jobs.size()] = static_cast<int64_t>(pieces.size());
  std::vector<float> states(static_cast<size_t>(state_size));

  // ---- merges ------------------------------------------------------------------------
  // Every sequence not written directly gathers its softmax from states: its
  // group's prefix pieces, then its own. Whichever thread completes the last
  // state a (sequence, KV head) awaits merges it, so one parallel region
  // does everything: under contention each region's closing barrier can
  // wait a whole time slice for a descheduled thread.
  std::vector<int64_t> merged;                 // the sequences merged
  std::vector<std::vector<Source>> sources;    // per merged sequence
  std::vector<std::vector<int64_t>> users(pieces.size());  // piece -> merged sequences
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t oj = own_job[b];
    if (first_piece[oj + 1] - first_piece[oj] == 1 && pieces[first_piece[oj]].state < 0)
      continue;
    std::vector<Source> from;
    const int64_t g = group_of ? group_of[b] : -1;
    if (g >= 0 && prefix_job[g] >= 0) {
      const Job& j = jobs[prefix_job[g]];
      const int64_t* mem = member_list.data() + j.member0;
      const int64_t at = std::find(mem, mem + j.members, b) - mem;
      for (int64_t p = first_piece[prefix_job[g]]; p < first_piece[prefix_job[g] + 1]; ++p)
        from.push_back({p, at * qpk});
    }
    for (int64_t p = first_piece[oj]; p < first_piece[oj + 1]; ++p) from.push_back({p, 0});
    for (const Source& src : from) users[src.piece].push_back(static_cast<int64_t>(merged.size()));
    merged.push_back(b);
    sources.push_back(std::move(from));
  }
  std::unique_ptr<std::atomic<int64_t>[]> awaiting(
      new std::atomic<int64_t>[merged.size() * kv_heads]);
  for (size_t i = 0; i < merged.size(); ++i)
    for (int64_t h = 0; h < kv_heads; ++h)
      awaiting[i * kv_heads + h].store(static_cast<int64_t>(sources[i].size()));

  auto merge = [&](int64_t i, int64_t h, Scratch& s) {
    s.row.resize(static_cast<size_t>(dim));
    float* acc = s.row.data();
    Q* dst = op + (merged[i] * heads + h * qpk) * dim;
    for (int64_t r = 0; r < qpk; ++r) {
      float m = -FLT_MAX, sum = 0.f;
      for (const Source& src : sources[i]) {
        const Piece& p = pieces[src.piece];
        const int64_t rows = jobs[p.job].members * qpk, at = src.row0 + r;
        const float* block = states.data() + p.state + h * rows * (dim + 2);
        merge_state(m, sum, acc, block[at], block[rows + at], block + 2 * rows + at * dim, dim);
      }
      write_normalised(acc, sum, dim, dst + r * dim);
    }
  };

  // ---- tasks -------------------------------------------------------------------------
  // Costliest first, for run_tasks; where members resume their group's prefix
  // state, the prefix pieces go first, in a phase of their own.
  const int64_t num_pieces = static_cast<int64_t>(pieces.size());
  const int64_t phase2 = resumes ? first_piece[own_jobs0] : num_pieces;
  auto cost = [&](int64_t i) {
    const Piece& p = pieces[i];
    return (p.end - p.begin) * (jobs[p.job].members * qpk + kKeyCost);
  };
  std::vector<int64_t> piece_order(num_pieces);
  for (int64_t i = 0; i < num_pieces; ++i) piece_order[i] = i;
  std::stable_sort(piece_order.begin(), piece_order.end(), [&](int64_t a, int64_t b) {
    return (a >= phase2) != (b >= phase2) ? a < phase2 : cost(a) > cost(b);
  });

  auto run_task = [&](int64_t task, Scratch& s) {
    const int64_t piece = task / kv_heads, h = task % kv_heads;
    const Piece& p = pieces[piece];
    const Job& j = jobs[p.job];
    const int64_t* mem = member_list.data() + j.member0;
    const int64_t rows = j.members * qpk, len = p.end - p.begin;
    float* block;
    if (p.state >= 0) {
      block = states.data() + p.state + h * rows * (dim + 2);
    } else {
      s.state.resize(static_cast<size_t>(rows * (dim + 2)));
      block = s.state.data();
    }
    float *m = block, *sum = block + rows, *acc = block + 2 * rows;
    if (j.resume_job >= 0) {  // the group prefix's state, complete (an earlier phase)
      const int64_t from_rows = jobs[j.resume_job].members * qpk, r0 = j.resume_row;
      const float* from =
          states.data() + pieces[first_piece[j.resume_job]].state + h * from_rows * (dim + 2);
      std::copy(from + r0, from + r0 + rows, m);
      std::copy(from + from_rows + r0, from + from_rows + r0 + rows, sum);
      const float* from_acc = from + 2 * from_rows + r0 * dim;
      std::copy(from_acc, from_acc + rows * dim, acc);
    }
    // Query rows: member i's qpk heads of KV head h, each seeing the keys of
    // this piece from its own window start on.
    auto row = [&](int64_t r) {
      const int64_t b = mem[r / qpk];
      return QueryRow<Q>{qp + (b * heads + h * qpk + r % qpk) * dim,
                         std::clamp<int64_t>(lo[b] - p.begin, 0, len), len - 1};
    };
    dispatch_dim(dim, [&](auto nv) {
      attend_rows<T, Q, decltype(nv)::value>(row, rows, kp + h * head_stride,
                                             vp + h * head_stride, row_stride,
                                             ap + offs[mem[0]] + p.begin, len, dim, sc, cap, s,
                                             m, sum, acc, /*amx_any=*/false, det,
                                             PackedKV{}, j.resume_job >= 0);
    });
    if (p.state < 0) {
      Q* dst = op + (mem[0] * heads + h * qpk) * dim;
      for (int64_t r = 0; r < rows; ++r)
        write_normalised(acc + r * dim, sum[r], dim, dst + r * dim);
      return;
    }
    // acq_rel: the last thread to finish sees every other thread's state.
    for (const int64_t i : users[piece])
      if (awaiting[i * kv_heads + h].fetch_sub(1, std::memory_order_acq_rel) == 1) merge(i, h, s);
  };
  // A thread takes a piece's KV heads together: fewer tasks, and a task per
  // (piece, KV head) measured no faster over the head-major blocks (AMX host,
  // 16 sequences in groups of 4: 12.6 -> 13.7 ms a step; distinct, 29.5 ->
  // 30.7). With fewer pieces than threads (deterministic mode never cuts a
  // job: one decode, or one group's prefix, is one piece) a task per KV head
  // instead, or cores would idle.
  auto run_pieces = [&](int64_t from, int64_t to) {
    if (to - from >= threads) {
      run_tasks(to - from, [&](int64_t i, Scratch& s) {
        for (int64_t h = 0; h < kv_heads; ++h) run_task(piece_order[from + i] * kv_heads + h, s);
      });
      return;
    }
    run_tasks((to - from) * kv_heads, [&](int64_t i, Scratch& s) {
      run_task(piece_order[from + i / kv_heads] * kv_heads + i % kv_heads, s);
    });
  };
  if (phase2 > 0) run_pieces(0, phase2);
  if (phase2 < num_pieces) run_pieces(phase2, num_pieces);
}

}  // namespace
