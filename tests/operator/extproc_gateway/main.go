// Command extproc-gateway drives an endpoint picker's ext-proc gRPC stream as a gateway (Envoy)
// does, for tests: no Envoy binary is served on these machines.
//
// Each JSON line on stdin is one request, {"path": "/v1/completions", "body": {...}}. For each,
// it opens a Process stream, sends the request headers and body, reads the picked endpoint from
// the x-gateway-destination-endpoint header mutation, POSTs the body to that endpoint, and
// streams the response headers and body back through the picker (so its per-request state ends
// as it would behind Envoy). One JSON line per request goes to stdout:
// {"endpoint": "ip:port", "status": 200, "body": "..."} or {"error": "..."}.
package main

import (
	"bufio"
	"bytes"
	"context"
	"crypto/tls"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"net/http"
	"os"
	"strconv"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	extproc "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"
)

const destinationHeader = "x-gateway-destination-endpoint"

type request struct {
	Path string          `json:"path"`
	Body json.RawMessage `json:"body"`
}

type result struct {
	Endpoint string `json:"endpoint,omitempty"`
	Status   int    `json:"status,omitempty"`
	Body     string `json:"body,omitempty"`
	Error    string `json:"error,omitempty"`
}

func headers(kv ...string) *corev3.HeaderMap {
	m := &corev3.HeaderMap{}
	for i := 0; i+1 < len(kv); i += 2 {
		m.Headers = append(m.Headers, &corev3.HeaderValue{Key: kv[i], RawValue: []byte(kv[i+1])})
	}
	return m
}

// pick runs the request half of the stream and returns the endpoint the picker chose.
func pick(stream extproc.ExternalProcessor_ProcessClient, n int, req request) (string, error) {
	err := stream.Send(&extproc.ProcessingRequest{Request: &extproc.ProcessingRequest_RequestHeaders{
		RequestHeaders: &extproc.HttpHeaders{Headers: headers(
			":method", "POST", ":path", req.Path, ":authority", "gateway.local",
			"content-type", "application/json", "x-request-id", fmt.Sprintf("gw-%d-%d", os.Getpid(), n),
		)},
	}})
	if err == nil {
		err = stream.Send(&extproc.ProcessingRequest{Request: &extproc.ProcessingRequest_RequestBody{
			RequestBody: &extproc.HttpBody{Body: req.Body, EndOfStream: true},
		}})
	}
	if err != nil {
		return "", err
	}
	endpoint := ""
	for gotBody := false; !gotBody; {
		resp, err := stream.Recv()
		if err != nil {
			return "", fmt.Errorf("picker: %w", err)
		}
		switch r := resp.Response.(type) {
		case *extproc.ProcessingResponse_RequestHeaders:
			for _, h := range r.RequestHeaders.GetResponse().GetHeaderMutation().GetSetHeaders() {
				if h.GetHeader().GetKey() == destinationHeader {
					endpoint = string(h.GetHeader().GetRawValue())
				}
			}
		case *extproc.ProcessingResponse_RequestBody:
			gotBody = true
		case *extproc.ProcessingResponse_ImmediateResponse:
			return "", fmt.Errorf("picker answered itself: %d %s",
				r.ImmediateResponse.GetStatus().GetCode(), r.ImmediateResponse.GetBody())
		default:
			return "", fmt.Errorf("unexpected picker response %T", r)
		}
	}
	if endpoint == "" {
		return "", fmt.Errorf("picker set no %s header", destinationHeader)
	}
	return endpoint, nil
}

// relay sends the engine's response through the picker, as Envoy does with a full-duplex body.
func relay(stream extproc.ExternalProcessor_ProcessClient, status int, body []byte) error {
	msgs := []*extproc.ProcessingRequest{
		{Request: &extproc.ProcessingRequest_ResponseHeaders{ResponseHeaders: &extproc.HttpHeaders{
			Headers: headers(":status", strconv.Itoa(status), "content-type", "application/json"),
		}}},
		{Request: &extproc.ProcessingRequest_ResponseBody{
			ResponseBody: &extproc.HttpBody{Body: body, EndOfStream: true},
		}},
	}
	for _, m := range msgs {
		if err := stream.Send(m); err != nil {
			return err
		}
		if _, err := stream.Recv(); err != nil {
			return fmt.Errorf("picker: %w", err)
		}
	}
	return stream.CloseSend()
}

func one(client extproc.ExternalProcessorClient, n int, req request, timeout time.Duration) result {
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	stream, err := client.Process(ctx)
	if err != nil {
		return result{Error: err.Error()}
	}
	endpoint, err := pick(stream, n, req)
	if err != nil {
		return result{Error: err.Error()}
	}
	httpReq, err := http.NewRequestWithContext(
		ctx, http.MethodPost, "http://"+endpoint+req.Path, bytes.NewReader(req.Body))
	if err != nil {
		return result{Endpoint: endpoint, Error: err.Error()}
	}
	httpReq.Header.Set("Content-Type", "application/json")
	resp, err := http.DefaultClient.Do(httpReq)
	if err != nil {
		return result{Endpoint: endpoint, Error: err.Error()}
	}
	body, err := io.ReadAll(resp.Body)
	resp.Body.Close()
	if err == nil {
		err = relay(stream, resp.StatusCode, body)
	}
	out := result{Endpoint: endpoint, Status: resp.StatusCode, Body: string(body)}
	if err != nil {
		out.Error = err.Error()
	}
	return out
}

func main() {
	addr := flag.String("epp", "", "the picker's ext-proc address, host:port")
	plaintext := flag.Bool("plaintext", false, "h2c instead of TLS (the picker's --secure-serving=false)")
	timeout := flag.Duration("timeout", 60*time.Second, "per request")
	flag.Parse()
	if *addr == "" {
		fmt.Fprintln(os.Stderr, "extproc-gateway: --epp is required")
		os.Exit(2)
	}
	// The picker serves TLS with a self-signed certificate by default; gateways skip verification.
	creds := credentials.NewTLS(&tls.Config{InsecureSkipVerify: true}) //nolint:gosec
	if *plaintext {
		creds = insecure.NewCredentials()
	}
	conn, err := grpc.NewClient(*addr, grpc.WithTransportCredentials(creds))
	if err != nil {
		fmt.Fprintln(os.Stderr, "extproc-gateway:", err)
		os.Exit(1)
	}
	defer conn.Close()
	client := extproc.NewExternalProcessorClient(conn)
	in := bufio.NewScanner(os.Stdin)
	in.Buffer(make([]byte, 1<<20), 16<<20)
	out := json.NewEncoder(os.Stdout)
	for n := 0; in.Scan(); n++ {
		var req request
		res := result{}
		if err := json.Unmarshal(in.Bytes(), &req); err != nil {
			res.Error = "bad input line: " + err.Error()
		} else {
			res = one(client, n, req, *timeout)
		}
		if err := out.Encode(res); err != nil {
			os.Exit(1)
		}
	}
}
