"""A request's plan in the router: its id, its prompts read (each of a completions batch's)
and its choices planned by the request front end (speculative.frontend), after its model is
checked and admission has room for it."""

import dataclasses
import uuid

from deployments.router_args import tree_shape
from speculative.frontend import RequestPlan, joined


class RequestPlanning:
    """The Router's planning of a request (deployments.router.Router, a base of it), which
    holds what is read here: check_model, admission, prompts and front_end."""

    async def plan(self, body, chat: bool) -> RequestPlan:
        """The body's prompt read (each of a completions batch's), its model checked, its
        choices planned."""
        self.check_model(body)
        # refused before its prompts are read when it could neither run nor wait now
        self.admission.check(body.n * (1 if chat else len(body.prompts())), body.priority)
        # the request's own id, which also keys its pool sessions: never the client's
        # request_id nor its x-request-id (two requests sharing one would share caches),
        # which name the answer alone, as vLLM's ("chatcmpl-<id>": header_request_id)
        kind = "chatcmpl" if chat else "cmpl"
        request_id = f"{kind}-{uuid.uuid4().hex}"
        prompts = [body] if chat else \
            [body.model_copy(update={"prompt": p}) for p in body.prompts()]
        others = (len(prompts) - 1) * body.n  # a batch's prompts' choices run side by side
        plan = await self.plan_one(request_id, prompts[0], chat) if len(prompts) == 1 else \
            joined(request_id, [await self.plan_one(f"{request_id}-{i}", one, chat, others)
                                for i, one in enumerate(prompts)])
        return plan if body.request_id is None else \
            dataclasses.replace(plan, answer_id=f"{kind}-{body.request_id}")

    async def plan_one(self, request_id: str, body, chat: bool, others: int = 0) -> RequestPlan:
        """One prompt's choices planned; others: the request's choices beside them (a
        completions batch's other prompts'), which run with them as the admitted ones do."""
        prompt = await self.prompts.read(body, chat)
        plan = self.front_end.plan(request_id, prompt.token_ids, prompt.sampling, body.n,
                                   prompt.stop_token_ids,
                                   num_speculative_tokens=body.num_speculative_tokens,
                                   pipelined=body.pipelined,
                                   drafter_kind=drafter_kind(body, prompt.prediction_ids),
                                   plain_steps=body.plain_steps,
                                   cache_key=body.prompt_cache_key or "",
                                   running=self.admission.running + others,
                                   tree=tree_shape(body.speculative_tree),
                                   context_limit=self.prompts.context_limit,
                                   free_in_reasoning=prompt.free_in_reasoning,
                                   prediction_token_ids=prompt.prediction_ids)
        return plan if prompt.text is None else dataclasses.replace(plan, prompt_text=prompt.text)


def drafter_kind(body, prediction_ids: tuple[int, ...]) -> str | None:
    """The drafter the body names (None: the pool's model), else prompt lookup where it
    predicts its output (the router's "ngram", which searches the prediction first:
    drafter.ngram); a named drafter is kept (the prediction then counts usage alone)."""
    if prediction_ids and "drafter" not in body.model_fields_set:
        return "ngram"
    return body.drafter
