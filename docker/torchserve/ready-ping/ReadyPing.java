package llava.sessions;

import java.io.IOException;
import java.nio.charset.StandardCharsets;
import java.util.ArrayList;
import java.util.List;
import java.util.Map;
import org.pytorch.serve.servingsdk.Context;
import org.pytorch.serve.servingsdk.Model;
import org.pytorch.serve.servingsdk.ModelServerEndpoint;
import org.pytorch.serve.servingsdk.Worker;
import org.pytorch.serve.servingsdk.annotations.Endpoint;
import org.pytorch.serve.servingsdk.annotations.helpers.EndpointTypes;
import org.pytorch.serve.servingsdk.http.Request;
import org.pytorch.serve.servingsdk.http.Response;

/**
 * SageMaker's /ping, healthy only once a question can be answered: every model has a worker whose
 * model is loaded. TorchServe 0.12's own /ping answers 200 as soon as a worker process runs, while
 * the model is still loading (and with no model at all), so SageMaker would route to an instance
 * that cannot answer yet. TorchServe consults plugin endpoints before its own, so this replaces it.
 */
@Endpoint(
    urlPattern = "ping",
    endpointType = EndpointTypes.INFERENCE,
    description = "200 once every model has a loaded worker, else 503")
public class ReadyPing extends ModelServerEndpoint {
  @Override
  public void doGet(Request request, Response response, Context context) throws IOException {
    Map<String, Model> models = context.getModels();
    List<String> loading = new ArrayList<>();
    for (Model model : models.values()) {
      boolean loaded = false;
      for (Worker worker : model.getModelWorkers()) {
        loaded |= worker.isRunning(); // the SDK's isRunning: the worker's model is loaded
      }
      if (!loaded) {
        loading.add(model.getModelName());
      }
    }
    String body;
    if (models.isEmpty()) {
      response.setStatus(503, "Service Unavailable");
      body = "{\"status\": \"Unhealthy\", \"message\": \"no model is registered yet\"}\n";
    } else if (!loading.isEmpty()) {
      response.setStatus(503, "Service Unavailable");
      body = "{\"status\": \"Unhealthy\", \"message\": \"loading: " + String.join(", ", loading)
          + "\"}\n";
    } else {
      response.setStatus(200, "OK");
      body = "{\"status\": \"Healthy\"}\n";
    }
    response.setContentType("application/json");
    response.getOutputStream().write(body.getBytes(StandardCharsets.UTF_8));
  }
}
