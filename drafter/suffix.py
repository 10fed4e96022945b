"""Suffix decoding (Oliaro et al., SuffixDecoding; vLLM's `suffix` method): propose what most
often followed the context's longest matching suffix, from token tries of bounded depth.

Two indexes: one over the request's own committed tokens (prompt and output), extended as
tokens commit, and one global over the outputs of recent finished requests, bounded in
outputs (`max_global_outputs`) and in tokens (`max_global_tokens`): the oldest outputs leave
while either is exceeded, and an output longer than the token bound alone keeps its last
tokens. It holds one output per request: a session closed by an eviction indexes its output so
far, which the rebuilt session's release replaces. The tries are uncompressed, about 6 KB a
token of text that never repeats (measured: 5.9-6.4 KB at depth 24), so the token bound is
the global index's memory bound: 32,768 tokens, about 200 MB at worst. Only committed
tokens are indexed, never a drafted token the target rejected.

A proposal finds, in each index, the longest suffix of the context (at most `max_depth`
tokens) that occurred before, then follows the most frequent continuation one token at a
time while the product of their frequencies (each child's count over its siblings') stays
at or above `min_token_prob`, for at most `max_spec_factor` x the match length tokens (2,
where vLLM's default is 1: measured in docs/benchmarks.md, 2 keeps up with prompt lookup on
a first pass and wins repeats). The index whose proposal has the larger expected length
(the sum of those products) wins.

No model: each proposed token's draft distribution is one-hot, as the n-gram drafter's,
so the rejection sampler keeps the output exactly the target's.
"""

from collections import OrderedDict

from drafter.ngram import NgramDrafter
from speculative.options import MAX_SPECULATIVE_TOKENS
from speculative.tree import main_chain_length


class Node:
    __slots__ = ("children", "count")

    def __init__(self) -> None:
        self.children: dict[int, Node] = {}
        self.count = 0  # the occurrences of the path from the root to this node


class SuffixIndex:
    """Every substring of at most max_depth tokens of the indexed sequences, with counts."""

    def __init__(self, max_depth: int) -> None:
        self.max_depth, self.root = max_depth, Node()

    def add(self, token_ids: list[int], sign: int = 1) -> None:
        """Count (sign 1) or uncount (-1) every substring of token_ids up to max_depth."""
        for start in range(len(token_ids)):
            self._walk(token_ids[start:start + self.max_depth], sign)

    def _walk(self, path: list[int], sign: int) -> None:
        node = self.root
        for token in path:
            child = node.children.get(token)
            if child is None:
                child = node.children[token] = Node()
            child.count += sign
            if child.count == 0:
                del node.children[token]  # nothing indexed passes here any more
                return
            node = child

    def extend(self, token_ids: list[int], new: int) -> None:
        """Count the substrings that end in the last `new` tokens of token_ids (which were
        indexed up to its last `new` tokens before)."""
        for end in range(len(token_ids) - new + 1, len(token_ids) + 1):
            start = max(0, end - self.max_depth)
            for first in range(start, end):  # each substring ending at end - 1, once
                self._count_last(token_ids[first:end])

    def _count_last(self, path: list[int]) -> None:
        node = self.root
        for token in path[:-1]:
            node = node.children[token]  # every proper prefix was counted already
        child = node.children.get(path[-1])
        if child is None:
            child = node.children[path[-1]] = Node()
        child.count += 1

    def room(self, num_tokens: int, max_spec_factor: float) -> int:
        """The continuation a match leaves room for: K, but no more than lets a match of
        depth L propose max_spec_factor x L tokens within the tries (a long K would
        otherwise squeeze the match to a token or two)."""
        balanced = int(self.max_depth * max_spec_factor / (max_spec_factor + 1))
        return max(1, min(num_tokens, balanced, self.max_depth - 1))

    def match(self, context: list[int], room: int = 1) -> tuple[Node | None, int]:
        """(the node of the longest suffix of context that occurs, its length): the longest
        one with a continuation (a child), since only those can propose, and short enough
        that `room` tokens of continuation fit within max_depth (a match at the tries' depth
        would propose one token however long the repeat)."""
        for length in range(min(self.max_depth - room, len(context)), 0, -1):
            node = self.root
            for token in context[-length:]:
                node = node.children.get(token)
                if node is None:
                    break
            if node is not None and node.children:
                return node, length
        return None, 0

    def propose(self, context: list[int], num_tokens: int, min_token_prob: float,
                max_spec_factor: float) -> tuple[list[int], float]:
        """(the proposed tokens, their expected accepted length under the counts)."""
        node, length = self.match(context, self.room(num_tokens, max_spec_factor))
        tokens: list[int] = []
        score, prob = 0.0, 1.0
        limit = min(num_tokens, int(max_spec_factor * length))
        while node is not None and node.children and len(tokens) < limit:
            token, child = max(node.children.items(), key=lambda item: item[1].count)
            prob *= child.count / sum(c.count for c in node.children.values())
            if prob < min_token_prob:
                break
            tokens.append(token)
            score += prob
            node = child
        return tokens, score


    def propose_tree(self, context: list[int], num_tokens: int, width: int, nodes: int,
                     min_token_prob: float, max_spec_factor: float
                     ) -> tuple[tuple[int, ...], tuple[int, ...], float]:
        """(tokens, parents, expected accepted length): `propose`'s chain as the main chain,
        then at its nodes up to width - 1 other continuations each (the next most frequent),
        the likeliest first while `nodes` (0: width per node) allows and their probability
        under the counts stays at or above min_token_prob."""
        node, length = self.match(context, self.room(num_tokens, max_spec_factor))
        tokens: list[int] = []
        parents: list[int] = []
        others: list[tuple[float, int, int]] = []  # (probability, parent, token)
        score, prob = 0.0, 1.0
        limit = min(num_tokens, int(max_spec_factor * length))
        while node is not None and node.children and len(tokens) < limit:
            total = sum(c.count for c in node.children.values())
            ranked = sorted(node.children.items(), key=lambda item: -item[1].count)
            here = len(tokens) - 1  # the parent of this level: ROOT or the last main node
            others += [(prob * c.count / total, here, t) for t, c in ranked[1:width]]
            token, child = ranked[0]
            prob *= child.count / total
            if prob < min_token_prob:
                break
            tokens.append(token)
            parents.append(here)
            score += prob
            node = child
        budget = min(nodes or width * len(tokens), MAX_SPECULATIVE_TOKENS) - len(tokens)
        kept = [o for o in sorted(others, reverse=True)[:max(0, budget)]
                if o[0] >= min_token_prob and o[1] < len(tokens)]
        for other_prob, parent, token in sorted(kept, key=lambda o: o[1]):
            tokens.append(token)
            parents.append(parent)
            score += other_prob
        return tuple(tokens), tuple(parents), score


class RequestIndex:
    """A request's own index (its session's `drafter_state`): extended as its tokens commit;
    when the session closes (released, evicted or swept), its output goes to
    `on_close(request_id, output)`."""

    def __init__(self, max_depth: int, request_id: str, prompt_len: int, on_close) -> None:
        self.index, self.indexed = SuffixIndex(max_depth), 0
        self.request_id, self.prompt_len, self.on_close = request_id, prompt_len, on_close

    def extended(self, committed: list[int]) -> SuffixIndex:
        if len(committed) > self.indexed:
            self.index.extend(committed, len(committed) - self.indexed)
            self.indexed = len(committed)
        return self.index

    def close(self, committed: list[int]) -> None:
        self.on_close(self.request_id, committed[self.prompt_len:])


class SuffixDrafter(NgramDrafter):
    """The n-gram drafter's sessions, checks and grammar handling; suffix tries propose."""

    def __init__(self, vocab_size: int, *, max_depth: int = 24, min_token_prob: float = 0.1,
                 max_spec_factor: float = 2.0, max_global_outputs: int = 256,
                 max_global_tokens: int = 32_768, **session_options) -> None:
        super().__init__(vocab_size, **session_options)
        if max_depth < 2 or not 0 < min_token_prob <= 1 or max_spec_factor <= 0 \
                or max_global_outputs < 0 or max_global_tokens < 0:
            raise ValueError("suffix drafting needs max_depth >= 2, 0 < min_token_prob <= 1, "
                             "max_spec_factor > 0, max_global_outputs >= 0 and "
                             "max_global_tokens >= 0")
        self.max_depth, self.min_token_prob = max_depth, min_token_prob
        self.max_spec_factor = max_spec_factor
        self.global_index = SuffixIndex(max_depth)
        self.outputs: OrderedDict[str, list[int]] = OrderedDict()  # by request, oldest first
        self.max_global_outputs, self.max_global_tokens = max_global_outputs, max_global_tokens
        self.global_tokens = 0  # in self.outputs

    def indexes(self, call, sequence) -> tuple["SuffixIndex", "SuffixIndex"]:
        """The request's own index (made on its session's first call or after a rebuild,
        extended to its committed tokens) and the global one."""
        if sequence.drafter_state is None:
            sequence.drafter_state = RequestIndex(self.max_depth, call.request_id,
                                                  call.prompt_len, self.remember)
        return sequence.drafter_state.extended(sequence.committed), self.global_index

    def lookup(self, call, sequence, context: list[int]) -> list[int]:
        proposals = [found.propose(context, call.num_speculative_tokens, self.min_token_prob,
                                   self.max_spec_factor)
                     for found in self.indexes(call, sequence)]
        tokens, _ = max(proposals, key=lambda proposal: proposal[1])
        return tokens

    def lookup_tree(self, call, sequence, context: list[int]):
        """The more promising index's tree: its most frequent continuation as the main chain,
        and the other frequent continuations at its nodes (SuffixIndex.propose_tree)."""
        proposals = [found.propose_tree(context, call.num_speculative_tokens, call.tree_width,
                                        call.tree_nodes, self.min_token_prob,
                                        self.max_spec_factor)
                     for found in self.indexes(call, sequence)]
        tokens, parents, _ = max(proposals, key=lambda proposal: proposal[2])
        return (tokens, parents) if main_chain_length(parents) < len(parents) else None

    def observe(self, request_id: str, token_ids: list[int]) -> None:
        """The request's committed tokens at its end (types.Drafter): its session takes the
        last rounds' tokens, which no later call brings, so its release indexes the whole
        output. Ignored unless they extend what the session holds."""
        sequence = self.sessions.get(request_id)
        if sequence is not None and token_ids[:len(sequence.committed)] == sequence.committed:
            sequence.committed = list(token_ids)

    def remember(self, request_id: str, output: list[int]) -> None:
        """A finished request's output (as far as this drafter saw it committed; its last
        max_global_tokens) joins the global index, in place of what the request's id held
        there (an evicted session's output so far: the rebuilt session's extends it, and
        indexed twice it counted double); the oldest leave while the outputs or their
        tokens are over their bounds."""
        self.forget(request_id)
        output = output[max(0, len(output) - self.max_global_tokens):]
        if not self.max_global_outputs or not output:
            return
        self.global_index.add(output)
        self.outputs[request_id] = output
        self.global_tokens += len(output)
        while len(self.outputs) > self.max_global_outputs or \
                self.global_tokens > self.max_global_tokens:
            self.forget(next(iter(self.outputs)))

    def forget(self, request_id: str) -> None:
        """The request's output leaves the global index (if it is there)."""
        output = self.outputs.pop(request_id, None)
        if output is not None:
            self.global_index.add(output, sign=-1)
            self.global_tokens -= len(output)
